"""The host's own work on the reserved cpus: systemd units that are neither Tidal's nor the kubelet's.

On a real node, ``system.slice`` (journald, containerd, monitoring agents), ``user.slice`` (operators'
shells) and ``init.scope`` run on every cpu, the dedicated and shared pools' included. The kubelet's
answer is ``reservedSystemCPUs`` plus the operator setting ``AllowedCPUs=`` on those slices by hand;
with ``--confine-host-units`` the agent asks systemd for it (``isolation.systemd``) and keeps it so as
the reserved pool changes.

Each unit's ``AllowedCPUs=`` as it was before Tidal set it is saved in the state directory first
(``host-units.json``, written atomically), so a crash between the save and the set, or any number of
restarts, keeps the operator's value: a later agent reads the saved one and never takes its own for
the original. Every drift check (``--drift-check-period``) reads the values back and sets again any
that someone else changed. A stop leaves the units held (as it leaves workloads confined); ``--revert`` gives every
unit its saved value back and removes the file. systemd keeps runtime properties until the next boot.

A unit whose own value was none (every cpu) is first given every cpu, then none: systemd 252 clears the
property but leaves the cgroup's ``cpuset.cpus`` as it last wrote it (make test-systemd found
``system.slice`` still on the reserved cpus after a revert), so the cgroup is opened to every cpu first.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Dict, List, Optional, Sequence

from agent.isolation.systemd import SystemdError, unit_type
from agent.statefiles import load_json, write_json
from agent.topology.parse import format_cpulist

log = logging.getLogger(__name__)
FILE = "host-units.json"


def parse_saved(doc) -> Dict[str, List[int]]:
    if not isinstance(doc, dict) or not isinstance(doc.get("original_allowed_cpus"), dict):
        raise ValueError("no original_allowed_cpus object")
    saved = {}
    for unit, cpus in doc["original_allowed_cpus"].items():
        unit_type(unit)
        if not isinstance(cpus, list) or not all(isinstance(c, int) and 0 <= c < 8192 for c in cpus):
            raise ValueError(f"{unit}: not a list of cpus")
        saved[unit] = sorted(set(cpus))
    return saved


class HostUnits:
    def __init__(self, units: Sequence[str], client, state_dir: str, every_cpu: Sequence[int],
                 echo: Callable[[str], None] = lambda _: None) -> None:
        for unit in units:
            unit_type(unit)
        self.units, self.client, self.echo = tuple(units), client, echo
        self.every_cpu = sorted(set(every_cpu))
        self.path = os.path.join(state_dir, FILE)
        self.original: Optional[Dict[str, List[int]]] = None
        self.held: Optional[List[int]] = None  # the cpus every unit was last set to
        self.errors: Dict[str, str] = {}
        self.sets = 0
        self.drift_repairs = 0

    def _originals(self) -> Dict[str, List[int]]:
        """The units' values before Tidal: from the state file when an earlier agent saved them, else read
        from systemd now and saved before anything is set."""
        if self.original is None:
            saved, warning = load_json(self.path, parse_saved, "the units' current values are taken as theirs")
            if warning:
                self.echo(f"tidal agent: warning: {warning}")
            saved = dict(saved or {})
            missing = [u for u in self.units if u not in saved]
            for unit in missing:
                saved[unit] = self.client.allowed_cpus(unit)
            if missing or not os.path.exists(self.path):
                write_json(self.path, {"original_allowed_cpus": saved})
            self.original = saved
        return self.original

    def _saved(self) -> Optional[Dict[str, List[int]]]:
        """``_originals()``, or None (one warning) when systemd cannot be asked for them."""
        try:
            return self._originals()
        except SystemdError as exc:
            self._failed("*", str(exc))
            return None

    def hold(self, cpus: Sequence[int], verify: bool = False) -> bool:
        """Every unit on ``cpus`` (no cpus: each gets its own value back). True when systemd was asked.
        ``verify``: read each unit's value back first and set again where someone changed it (an
        operator's ``systemctl set-property``, a unit file's ``AllowedCPUs=`` on ``daemon-reload``)."""
        wanted = sorted(set(cpus))
        if not wanted:
            return self.release(remove=False)
        if wanted == self.held and not self.errors and verify:
            drifted = []
            for unit in self.units:
                try:
                    if self.client.allowed_cpus(unit) != wanted:
                        drifted.append(unit)
                except SystemdError as exc:
                    self._failed(unit, str(exc))
            if drifted:
                self.echo(f"tidal agent: host units {', '.join(drifted)} were moved off the reserved cpus "
                          f"{format_cpulist(wanted)} by someone else: held there again")
                self.drift_repairs += len(drifted)
                self.held = None  # set them all again below
        if wanted == self.held and not self.errors:
            return False
        originals = self._saved()
        if originals is None:
            return False
        for unit in self.units:
            try:
                self.client.set_allowed_cpus(unit, wanted)
                self.sets += 1
                self.errors.pop(unit, None)
            except SystemdError as exc:
                self._failed(unit, str(exc))
        self.errors.pop("*", None)
        if self.held != wanted:
            self.echo(f"tidal agent: host units {', '.join(self.units)} held on the reserved cpus "
                      f"{format_cpulist(wanted)} (systemd AllowedCPUs=, runtime; theirs before: "
                      f"{', '.join(u + ' ' + (format_cpulist(c) or 'all') for u, c in sorted(originals.items()))})")
        self.held = wanted
        return True

    def release(self, remove: bool = True) -> bool:
        """Each unit's value from before Tidal; the saved file goes (``remove``) once all are back."""
        if self.original is None and not os.path.exists(self.path):
            return False
        originals = self._saved()
        if originals is None:
            return False
        failed = False
        for unit, cpus in sorted(originals.items()):
            try:
                if not cpus and self.held != self.every_cpu:
                    self.client.set_allowed_cpus(unit, self.every_cpu)  # the cgroup opened (see above)
                    self.sets += 1
                self.client.set_allowed_cpus(unit, cpus)
                self.sets += 1
            except SystemdError as exc:
                self._failed(unit, str(exc))
                failed = True
        self.held = None
        if remove and not failed:
            os.unlink(self.path)
            self.original = None
        return True

    def _failed(self, unit: str, error: str) -> None:
        if self.errors.get(unit) != error:
            self.echo(f"tidal agent: warning: holding {unit} on the reserved cpus: {error}")
        self.errors[unit] = error

    def status(self) -> Dict[str, object]:
        return {"units": list(self.units), "held_cpus": format_cpulist(self.held or []),
                "original_allowed_cpus": {u: format_cpulist(c) for u, c in sorted((self.original or {}).items())},
                "errors": dict(self.errors), "sets": self.sets, "drift_repairs": self.drift_repairs}

