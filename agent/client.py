"""A small client of the agent's local API (used by the CLI)."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any, Tuple

from agent.errors import TidalError


class AgentUnavailable(TidalError):
    pass


class ApiError(TidalError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class AgentClient:
    def __init__(self, socket_path: str, timeout: float = 30.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None) -> Tuple[int, Any]:
        conn = _UnixConnection(self.socket_path, self.timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise AgentUnavailable(f"no agent at {self.socket_path} ({exc.strerror}); start one with "
                                   f"`tidal agent` or `make run`") from None
        except PermissionError:
            raise AgentUnavailable(f"{self.socket_path}: permission denied (the socket is root's, mode 0600)") from None
        except OSError as exc:
            raise AgentUnavailable(f"{self.socket_path}: {exc}") from None
        except http.client.HTTPException as exc:  # e.g. the agent died mid-answer (IncompleteRead)
            raise AgentUnavailable(f"{self.socket_path}: the agent closed the connection before it answered "
                                   f"({type(exc).__name__}); whether {method} {path} took effect is unknown") from None
        finally:
            conn.close()
        try:
            decoded = json.loads(data) if data else None
        except json.JSONDecodeError:
            decoded = {"error": data.decode(errors="replace")}
        return response.status, decoded

    def request(self, method: str, path: str, body: Any = None) -> Any:
        status, data = self.call(method, path, body)
        if status >= 400:
            message = data.get("error") if isinstance(data, dict) else str(data)
            raise ApiError(status, message or f"HTTP {status}")
        return data
