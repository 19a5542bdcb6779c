"""A real Hadoop YARN on loopback for the YARN tier: a ResourceManager and one NodeManager as plain
``java -cp`` processes from the jars ``make yarn-testbin`` fetched from Maven Central.

Everything binds to 127.0.0.1 on ports picked free; the NodeManager's RPC port is left random, as a
default NodeManager's is, so Tidal has to find its node id. Java 17 needs the ``--add-opens`` below
(Hadoop's reflection into the JDK), for the daemons and for the containers (through the NM's
admin environment).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

HADOOP_VERSION = "3.4.3"
ADD_OPENS = " ".join(f"--add-opens={m}=ALL-UNNAMED" for m in (
    "java.base/java.lang", "java.base/java.util", "java.base/java.util.concurrent", "java.base/java.net",
    "java.base/java.io", "java.base/java.nio", "java.base/sun.nio.ch", "java.base/java.lang.reflect",
    "java.base/java.util.regex", "java.base/java.text", "java.base/sun.net.util", "java.base/java.security",
    "java.base/javax.net.ssl", "java.base/java.util.concurrent.atomic"))


def testbin() -> Optional[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tidal" / "yarn"
    lib = Path(os.environ.get("TIDAL_YARN_TESTBIN", cache / f"hadoop-{HADOOP_VERSION}")) / "lib"
    return lib if (lib.parent / "done").is_file() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _site(properties: Dict[str, str]) -> str:
    rows = "".join(f"  <property><name>{k}</name><value>{v}</value></property>\n" for k, v in properties.items())
    return f'<?xml version="1.0"?>\n<configuration>\n{rows}</configuration>\n'


def site_properties(fragment: str) -> Dict[str, str]:
    """The properties of a yarn-site.xml fragment (what ``tidal yarn config`` prints)."""
    import re

    return dict(re.findall(r"<property><name>([^<]+)</name><value>([^<]*)</value></property>", fragment))


class Yarn:
    def __init__(self, lib: Path, work: Path, java_home: Optional[str] = None,
                 node_manager: Optional[Dict[str, str]] = None) -> None:
        """``node_manager``: the NodeManager's properties for Tidal (``tidal yarn config``), over the rest."""
        self.lib, self.work = lib, work
        self.java_home = java_home or str(Path(os.path.realpath(subprocess.check_output(
            ["sh", "-c", "command -v java"], text=True).strip())).parent.parent)
        self.conf = work / "conf"
        self.conf.mkdir(parents=True, exist_ok=True)
        self.ports = {name: free_port() for name in ("rm", "scheduler", "tracker", "admin", "web", "localizer",
                                                     "nmweb")}
        self.web = f"http://127.0.0.1:{self.ports['web']}"
        self.procs: Dict[str, subprocess.Popen] = {}
        self.logs: Dict[str, Path] = {}
        yarn = {
            "yarn.resourcemanager.hostname": "127.0.0.1",
            "yarn.resourcemanager.address": f"127.0.0.1:{self.ports['rm']}",
            "yarn.resourcemanager.scheduler.address": f"127.0.0.1:{self.ports['scheduler']}",
            "yarn.resourcemanager.resource-tracker.address": f"127.0.0.1:{self.ports['tracker']}",
            "yarn.resourcemanager.admin.address": f"127.0.0.1:{self.ports['admin']}",
            "yarn.resourcemanager.webapp.address": f"127.0.0.1:{self.ports['web']}",
            "yarn.resourcemanager.connect.retry-interval.ms": "1000",
            "yarn.nodemanager.hostname": "127.0.0.1",
            "yarn.nodemanager.localizer.address": f"127.0.0.1:{self.ports['localizer']}",
            "yarn.nodemanager.webapp.address": f"127.0.0.1:{self.ports['nmweb']}",
            "yarn.nodemanager.local-dirs": str(work / "nm-local"),
            "yarn.nodemanager.log-dirs": str(work / "nm-logs"),
            "yarn.nodemanager.vmem-check-enabled": "false",
            "yarn.nodemanager.pmem-check-enabled": "false",
            "yarn.nodemanager.disk-health-checker.max-disk-utilization-per-disk-percentage": "99.9",
            "yarn.nodemanager.admin-env": f"JAVA_TOOL_OPTIONS={ADD_OPENS}",
            "yarn.nodemanager.env-whitelist": "JAVA_HOME,PATH,LANG,TZ",
            "yarn.application.classpath": f"{self.conf}:{lib}/*",  # containers read the same yarn-site.xml
            "yarn.log-aggregation-enable": "false",
            "yarn.timeline-service.enabled": "false",
            **(node_manager or {}),
        }
        (self.conf / "yarn-site.xml").write_text(_site(yarn))
        # the RM's default scheduler (capacity) with one queue, as a fresh install has it
        (self.conf / "capacity-scheduler.xml").write_text(_site({
            "yarn.scheduler.capacity.root.queues": "default",
            "yarn.scheduler.capacity.root.default.capacity": "100",
            "yarn.scheduler.capacity.root.default.maximum-capacity": "100",
            "yarn.scheduler.capacity.maximum-am-resource-percent": "1.0"}))
        (self.conf / "core-site.xml").write_text(_site({"fs.defaultFS": "file:///",
                                                         "hadoop.tmp.dir": str(work / "tmp")}))
        (self.conf / "log4j.properties").write_text(
            "log4j.rootLogger=INFO,console\nlog4j.appender.console=org.apache.log4j.ConsoleAppender\n"
            "log4j.appender.console.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.console.layout.ConversionPattern=%d{ISO8601} %p %c{2}: %m%n\n")

    def env(self) -> Dict[str, str]:
        return dict(os.environ, JAVA_HOME=self.java_home, HADOOP_CONF_DIR=str(self.conf),
                    JAVA_TOOL_OPTIONS=ADD_OPENS)

    def java(self, main: str, *args: str, heap: str = "384m") -> List[str]:
        return [f"{self.java_home}/bin/java", f"-Xmx{heap}", "-Dhadoop.log.dir=" + str(self.work / "logs"),
                "-Dlog4j.configuration=file:" + str(self.conf / "log4j.properties"),
                "-cp", f"{self.conf}:{self.lib}/*", main, *args]

    def start(self, name: str, argv: List[str]) -> subprocess.Popen:
        self.logs[name] = self.work / f"{name}.log"
        log = open(self.logs[name], "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start_rm(self) -> subprocess.Popen:
        return self.start("rm", self.java("org.apache.hadoop.yarn.server.resourcemanager.ResourceManager"))

    def nm_argv(self) -> List[str]:
        return self.java("org.apache.hadoop.yarn.server.nodemanager.NodeManager")

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def rest(self, path: str):
        with urllib.request.urlopen(self.web + path, timeout=10) as response:
            return json.loads(response.read())

    def nodes(self) -> List[dict]:
        try:
            return list((self.rest("/ws/v1/cluster/nodes").get("nodes") or {}).get("node") or [])
        except OSError:
            return []

    def tail(self, name: str, lines: int = 40, since: int = 0) -> str:
        """The last ``lines`` of a daemon's log (appended to across its restarts), from byte ``since`` on."""
        path = self.logs.get(name)
        if not path or not path.exists():
            return ""
        with open(path, "rb") as handle:
            handle.seek(since)
            return "\n".join(handle.read().decode(errors="replace").splitlines()[-lines:])

    def log_size(self, name: str) -> int:
        """Where a daemon's log ends now: ``tail(name, since=...)`` reads only what it writes after."""
        path = self.logs.get(name)
        return path.stat().st_size if path and path.exists() else 0

    def wait_rm(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs.get("rm")
            assert proc is not None and proc.poll() is None, f"the RM exited:\n{self.tail('rm')}"
            try:
                if self.rest("/ws/v1/cluster/info")["clusterInfo"]["state"] == "STARTED":
                    return
            except (OSError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"the RM did not start in {timeout} s:\n{self.tail('rm')}")

    def distributed_shell(self, script: Path, seconds: float, containers: int = 1) -> List[str]:
        """The distributed-shell client running ``script`` (a file: the application ships it as is) in
        ``containers`` containers; it gives up after ``seconds``."""
        jar = next(self.lib.glob("hadoop-yarn-applications-distributedshell-*.jar"))
        return self.java("org.apache.hadoop.yarn.applications.distributedshell.Client", "-jar", str(jar),
                         "-shell_script", str(script), "-num_containers", str(containers),
                         "-master_memory", "256", "-master_vcores", "1", "-container_memory", "256",
                         "-container_vcores", "1", "-timeout", str(int(seconds * 1000)), heap="256m")
