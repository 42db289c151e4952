"""One run per folder: the lock, the run's record, and what "finished" means.

A run folder (``--output_dir``) holds exactly one run; three files keep it that way:
``run.lock`` (an ``flock`` the kernel releases when the process dies, naming its holder),
``run.json`` (the run's config and every launch of it: a fresh start over another run is
refused, naming what differs, unless ``--overwrite_output_dir``) and the finished markers
(each phase's ``phase_done.json``, then the run's ``summary.json``). A folder that is not empty
and holds no run is refused (:func:`foreign_folder`). The rules: docs/training.md, "One run per
folder". A multi-phase run has one ``phase<i>-<name>`` folder per phase.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crystal_grpo.errors import CrystalError, some_of
from crystal_grpo.jsonl import atomic_write_text, read_json
from crystal_grpo.paths import name_problem
from crystal_grpo.train.run.checkpoints import latest_complete, sha256_file
from crystal_grpo.train.run.layout import (
    ATTEMPT_FILES,
    FINAL,
    LOCK,
    MARKER,
    PHASE_DONE,
    PROGRESS,
    RECORD,
    RUN_MARKERS,
    SAMPLES_GLOB,
    STEPS_GLOB,
    SUMMARY,
    checkpoint_folders,
    is_finished,
    phase_dir,
    phase_folders,
    run_entry,
    run_folder,
    step_of,
)
from crystal_grpo.train.run.model_card import is_run_card
from crystal_grpo.typed import to_dict

logger = logging.getLogger(__name__)


class RunFolderError(CrystalError, RuntimeError):
    """The folder holds another run, or is in use; the message says which and what to do."""


# --- the lock ----------------------------------------------------------------------------
def _process_start(pid: int) -> str | None:
    """The kernel's start time of a process (tells a reused pid from the original), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class RunLock:
    """``with RunLock(run_dir, command, say):`` one live run in ``run_dir`` at a time (``name`` and
    ``what``: another holder's lock file, e.g. a sweep's in its sweep folder)."""

    def __init__(
        self,
        run_dir: Path,
        command: str,
        say: Callable[[str], None] = logger.warning,
        name: str = LOCK,
        what: str = "run",
    ) -> None:
        self.path, self.command, self.say, self.what = Path(run_dir) / name, command, say, what
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise RunFolderError(
                f"{self.path.parent} is in use by a live {self.what} "
                f"({_describe(read_json(self.path))}); wait for it, stop it, or choose another "
                "--output_dir"
            ) from None
        stale = _read_fd(fd)
        if stale:  # the holder died without releasing (killed): the kernel dropped its flock
            self.say(f"taking over the lock of a {self.what} that is gone ({_describe(stale)})")
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "process_start": _process_start(os.getpid()),
            "command": self.command,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # released cleanly: an empty lock file is nobody's
            os.close(self.fd)  # (kept, not unlinked: unlinking races with a waiting opener)
            self.fd = None


def wait_for_holder(run_dir: Path, say: Callable[[str], None], name: str = LOCK) -> None:
    """Until no live process holds ``run_dir``'s lock: a run that outlived the sweep that started it
    (a sweep killed with SIGKILL: the run, told by the kernel, is saving its last step) or one started
    by hand. Says who it waits for; returns at once when none does."""
    import fcntl

    path = Path(run_dir) / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file: no run
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            say(f"{run_dir} is in use by a live run ({_describe(_read_fd(fd))}): waiting for it to stop")
            fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)  # (releases the lock)


def _read_fd(fd: int) -> dict | None:
    try:
        data = json.loads(os.pread(fd, 65536, 0) or b"null")
    except ValueError:
        return {"pid": "?", "host": "?", "command": "an unreadable lock file"}
    return data if isinstance(data, dict) else None


def _describe(holder: dict | None) -> str:
    if not holder:
        return "holder unknown"
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started', '?')}: "
        f"{holder.get('command', '?')}"
    )


# --- what the folder holds ---------------------------------------------------------------
def holds_run(run_dir: Path) -> bool:
    """Whether training ever ran here: logs, checkpoints, a finished phase (``run.json`` of a
    start that failed before its first step does not count)."""
    if not run_dir.is_dir():
        return False
    return is_finished(run_dir) or any(_started(f) for f in (run_dir, *(p for _, p in phase_folders(run_dir))))


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "p": [{"c": 2}]}`` -> ``{"a.b": 1, "p.0.c": 2}`` (an empty section has no keys)."""
    items = (
        d.items()
        if isinstance(d, dict)
        else enumerate(d)
        if isinstance(d, list) and d and all(isinstance(x, dict) for x in d)
        else None
    )
    if items is None:
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flat(v, f"{prefix}{k}."))
    return out


_UNSET = "unset"


def config_diff(old: dict, new: dict, ignore: Sequence[str] = ()) -> list[str]:
    """``key: old -> new`` for every setting that differs (flattened section.key names)."""
    a, b = _flat(old), _flat(new)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k, _UNSET) != b.get(k, _UNSET) and k not in ignore]
    return [f"{k}: {a.get(k, _UNSET)!r} -> {b.get(k, _UNSET)!r}".replace(f"'{_UNSET}'", _UNSET) for k in keys]


# --- finished phases ---------------------------------------------------------------------
@dataclass
class PhaseState:
    """A phase folder as found: ``done`` (trained its steps), ``extend`` (done, but now asked
    for more steps), ``open`` (not finished: fresh or interrupted)."""

    folder: Path
    status: str
    reached: int | None = None
    record: dict | None = None


def phase_state(folder: Path, max_steps: Any) -> PhaseState:
    record = read_json(folder / PHASE_DONE)
    if record is None and is_finished(folder) and (folder / FINAL).is_dir():
        ckpt, _ = latest_complete(folder)  # a single-phase run finished before phase_done.json existed
        record = {"max_steps": max_steps, "global_step": step_of(ckpt) if ckpt else None}
    if record is None:
        return PhaseState(folder, "open")
    reached = record.get("global_step", record.get("max_steps"))
    asked = max_steps if max_steps is not None else -1  # unset: transformers' -1 (epochs)
    recorded = record.get("max_steps")
    same = (recorded if recorded is not None else -1) == asked
    if same or (isinstance(asked, int) and asked > 0 and isinstance(reached, int) and asked <= reached):
        return PhaseState(folder, "done", reached, record)
    return PhaseState(folder, "extend", reached, record)


def mark_phase_done(folder: Path, max_steps: Any, global_step: int, validation: dict) -> None:
    atomic_write_text(
        folder / PHASE_DONE,
        json.dumps({"max_steps": max_steps, "global_step": global_step, "validation": validation}, indent=2),
    )


def clear_attempt(folder: Path) -> list[str]:
    """Remove a killed attempt's logs and records (a phase starting over logs from step 0)."""
    gone = [name for name in ATTEMPT_FILES if (folder / name).exists()]
    for name in gone:
        (folder / name).unlink()
    for p in [*folder.glob(SAMPLES_GLOB), *folder.glob(STEPS_GLOB)]:
        p.unlink()
    return gone


def clear_run(run_dir: Path, keep: Sequence[str] = (LOCK,)) -> list[str]:
    """Remove what a run wrote in ``run_dir`` and nothing else; returns what stays (``sub/`` for a
    folder), ``keep`` aside. The one place files of a run folder are removed wholesale: a file or
    folder goes only when :func:`~crystal_grpo.train.run.layout.run_entry` names it the run's (a
    phase folder goes once it is empty), never through a link: a link under a run's name is
    removed as a link (its target untouched: the new run would write through it), any other
    stays; inside a checkpoint ``rmtree`` unlinks one without following it."""
    kept = []
    for p in sorted(run_dir.iterdir()):
        what = None if p.name in keep else run_entry(p)
        if what == "card":
            what = "file" if is_run_card(p) else None
        if what in ("file", "link"):
            p.unlink()
        elif what == "folder":
            shutil.rmtree(p)
        elif what == "phase":
            inside = clear_run(p, keep=())
            kept += [f"{p.name}/{name}" for name in inside]
            if not inside:
                p.rmdir()
        elif p.name not in keep:
            kept.append(p.name + ("/" if p.is_dir() and not p.is_symlink() else ""))
    return kept


def kept_line(kept: list[str]) -> str:
    """``kept 2 files this run did not write: notes.txt, sub/``."""
    return f"kept {len(kept)} file{'s' if len(kept) > 1 else ''} this run did not write: {some_of(kept, 6)}"


def foreign_folder(run_dir: Path) -> str | None:
    """Why a run may not write into ``run_dir``, or None: a run writes only into a new or empty
    folder, or one holding this project's run (a :data:`~crystal_grpo.train.run.layout.RUN_MARKERS`
    file), never among someone else's files, and under a name the run's writers take as text."""
    unnamed = name_problem("--output_dir", str(run_dir))
    if unnamed:
        return unnamed
    if not os.path.lexists(run_dir):  # (Path.exists raises for a name too long)
        cannot = _cannot_make(run_dir)
        return f"--output_dir {run_dir} cannot be made: {cannot}; choose another --output_dir" if cannot else None
    if not run_dir.is_dir():
        return f"--output_dir {run_dir} is not a folder; choose another --output_dir"
    held = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in run_dir.iterdir())
    if not held or any((run_dir / m).is_file() for m in RUN_MARKERS):
        return None
    return (
        f"--output_dir {run_dir} holds {some_of(held)} but no run of this project (no {RECORD}): a run writes "
        "only into a new or empty folder or its own run folder, so nothing here is touched; choose another "
        "--output_dir"
    )


def unwritable(folder: Path) -> str | None:
    """Why this process cannot write into the existing ``folder`` (``is on a read-only file system``,
    ``is not writable by this user``), or None."""
    if not folder.is_dir() or os.access(folder, os.W_OK):
        return None
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return "is on a read-only file system"
    return f"is not writable by this user (uid {os.getuid()})"


def read_only_problem(run_dir: Path) -> str | None:
    """Why a launch cannot go on in a folder it may not write into, or None: a run writes its
    lock, record, logs and checkpoints there. A finished run needs no write (its launch has
    nothing to do, and says so)."""
    where = None if is_finished(run_dir) else unwritable(run_dir)
    return (
        f"{run_dir} {where}: a run writes its lock, logs and checkpoints there; make it writable, or copy the "
        "run folder to a writable place and resume it there (--output_dir)"
        if where
        else None
    )


def _cannot_make(run_dir: Path) -> str | None:
    """Why the folder ``run_dir`` (not there yet) cannot be made, or None: a file on its way, a
    name longer than the file system takes, or a place that takes no new folder (read-only, no
    permission, a virtual file system such as /proc), the last found by making and removing a
    scratch folder there (a unique name: the processes of one launch may try at once)."""
    path = Path(os.path.abspath(run_dir))
    base = next(p for p in path.parents if os.path.lexists(p))
    if not base.is_dir():
        return f"{base} is not a folder"
    limit = os.pathconf(base, "PC_NAME_MAX")
    for part in path.relative_to(base).parts:
        if len(os.fsencode(part)) > limit:
            return f"the name {part[:24]}... is {len(os.fsencode(part))} bytes long, the file system takes {limit}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".crystal-grpo-probe-", dir=base))
    except OSError as err:
        return f"{base} takes no new folder ({err.strerror})"
    return None


# --- the decision at launch --------------------------------------------------------------
@dataclass
class Launch:
    """What a launch does with its folder: ``finished`` (nothing), ``fresh`` or ``resume``."""

    action: str
    summary: dict | None = None


def plan_launch(
    run_dir: Path,
    config: dict,
    max_steps: Sequence[Any],
    resume: str | None,
    overwrite: bool,
    say: Callable[[str], None],
    write: bool,
    data: dict[str, str] | None = None,
) -> Launch:
    """Decide (and, with ``write``, record) what this launch does with ``run_dir``.

    ``config`` is the run's resolved config (what ``run.json`` keeps), ``max_steps`` each
    phase's configured steps, ``data`` the digest of each data file (:func:`data_digests`),
    recorded with the launch: a resume names each file whose content changed since the last
    launch. Every rank calls this; only the main process writes.
    """
    record = read_record(run_dir, say, write)
    phases = config.get("phases") or []
    folders = [phase_dir(run_dir, i, p.get("name", ""), len(phases)) for i, p in enumerate(phases or [{}])]
    if overwrite and holds_run(run_dir):
        kept = clear_run(run_dir) if write else []
        line = f"--overwrite_output_dir: removed the run that was in {run_dir}"
        say(f"{line}; {kept_line(kept)}" if kept else line)
    elif holds_run(run_dir):
        states = [phase_state(f, m) for f, m in zip(folders, max_steps)]
        diff = config_diff(record["config"], config) if record else None
        finished = is_finished(run_dir) and all(s.status == "done" for s in states)
        if finished and (resume or diff == []):
            steps = ", ".join(str(s.reached) for s in states)
            newest = latest_complete(Path(resume).parent)[0] if resume not in (None, "latest") else None
            if newest is not None and newest.resolve() != Path(resume).resolve():
                raise RunFolderError(
                    f"{run_dir}: this run already finished (step {steps}); resuming its older "
                    f"{resume} would train its steps again over its results: start a new run from "
                    f"its weights (--model.name_or_path {resume}), or start again with "
                    "--overwrite_output_dir"
                )
            say(
                f"{run_dir}: this run already finished (step {steps}); nothing to do"
                + (f" (settings now differ: {some_of(diff, sep='; ')})" if diff else "")
                + ". Train more with a larger training.max_steps and --resume_from_checkpoint latest, or start "
                "again with --overwrite_output_dir"
            )
            return Launch("finished", read_json(run_dir / SUMMARY))
        if not resume:
            what = (
                "a run with other settings: " + some_of(diff, sep="; ")
                if diff
                else "the same run, not finished"
                if diff == []
                else "a run (no run.json: an older version wrote it)"
            )
            raise RunFolderError(
                f"{run_dir} already holds {what}. Resume it with --resume_from_checkpoint latest, "
                "start it again with --overwrite_output_dir, or choose another --output_dir"
            )
        extending = [i for i, s in enumerate(states) if s.status == "extend"]
        if extending:
            i = extending[0]
            later = [s for s in states[i + 1 :] if s.status != "open" or _started(s.folder)]
            if later:
                raise RunFolderError(
                    f"{folders[i]} finished at step {states[i].reached}, and later phases started from it: more "
                    f"steps there would need them retrained. Start a new run (--output_dir) instead"
                )
            say(f"{folders[i]}: finished at step {states[i].reached}; continuing to training.max_steps {max_steps[i]}")
        others = [d for d in diff or [] if not d.split(":")[0].endswith("max_steps")]
        if others:
            say(f"resuming with settings that differ from the run's: {some_of(others, sep='; ')}")
        before = next((x["data"] for x in reversed((record or {}).get("launches", [])) if x.get("data")), {})
        for path, digest in (data or {}).items():
            if before.get(path, digest) != digest:
                say(
                    f"warning: {path} changed since this run's last launch ({before[path]} -> {digest}): the steps "
                    "from here train on its new content, the steps before on the old"
                )
        _record(run_dir, config, record, "resume", write, data)
        return Launch("resume")
    elif resume:
        say(f"no run in {run_dir} yet: starting fresh")
    _record(run_dir, config, None, "fresh", write, data)
    return Launch("fresh")


def marked_run(run_dir: Path) -> str | None:
    """The run id its checkpoints' completion markers name (the most often named), for a run
    resumed without one in ``run.json``: an unreadable record kept aside, or one of an older version
    (whose markers name none: then a new id)."""
    named = [
        str((read_json(c / MARKER) or {}).get("run") or "").split("/")[0]
        for folder in (run_dir, *(p for _, p in phase_folders(run_dir)))
        for c in checkpoint_folders(folder)
    ]
    named = [n for n in named if n]
    return max(set(named), key=named.count) if named else None


def reopen(phase: Path) -> None:
    """A phase resumes from a checkpoint known to fit (train/grpo.py ``run_phase``): it and its run
    are no longer finished until they are again. Only then, so that a resume that cannot go on
    leaves a finished run finished."""
    (phase / PHASE_DONE).unlink(missing_ok=True)
    (run_folder(phase) / SUMMARY).unlink(missing_ok=True)


def restart_problem(phase: Path) -> str | None:
    """Why a phase asked to resume that holds no complete checkpoint of its run must not start over
    at step 0 (which removes its logs), or None: it finished (its steps are in its logs and
    ``final/``), or it holds checkpoints that were complete once (a completion marker) and are
    skipped now (corrupted, another run's). A phase stopped before its first complete checkpoint
    starts over."""
    finished = (phase / PHASE_DONE).is_file()
    marked = [f.name for f in checkpoint_folders(phase) if (f / MARKER).is_file()]
    if not finished and not marked:
        return None
    why = "it finished" if finished else f"{some_of(marked)} {'was' if len(marked) == 1 else 'were'} complete once"
    skipped = latest_complete(phase, checksums=True)[1]
    return (
        f"cannot resume {phase}: {why}, but no checkpoint of this run there can be resumed"
        + (f" ({skipped[0]}{'; ...' if len(skipped) > 1 else ''})" if skipped else "")
        + ", and starting it over would remove its logs; nothing was changed. Start the run again with "
        "--overwrite_output_dir, or start a new run (--output_dir)"
    )


def data_digests(paths: Sequence[str]) -> dict[str, str]:
    """``{path: digest}`` of each local data file or folder: a file's sha256 (read once, about
    a second per GB), a folder's over its files' names and sizes (its contents are not read);
    names that are not local paths (Hub ids) are left out."""
    out = {}
    for name in dict.fromkeys(p for p in paths if p):
        path = Path(name)
        if path.is_file():
            out[name] = "sha256:" + sha256_file(path)[:16]
        elif path.is_dir():
            listing = "".join(
                f"{p.relative_to(path)}\t{p.stat().st_size}\n" for p in sorted(path.rglob("*")) if p.is_file()
            )
            out[name] = "names+sizes:" + hashlib.sha256(listing.encode()).hexdigest()[:16]
    return out


def unshared_problem(phase: Path) -> str | None:
    """Why the processes of this run do not share one run folder, or None: every rank reads the
    launch record the main process wrote into ``run.json`` and the records must agree. Nodes that
    each have their own disk at that path (HF's ``save_on_each_node``) each hold part of every
    checkpoint: node 0's was marked complete without the other ranks' DeepSpeed shards and RNG
    states, and no resume could be right. A collective: every rank calls it; one process: None."""
    from crystal_grpo.distributed import barrier, gather_objects, rank_and_world

    if rank_and_world()[1] == 1:
        return None
    barrier()  # the main process has written the record (a process group made earlier is no meeting point)
    record = read_json(run_folder(phase) / RECORD)
    seen = json.dumps((record or {}).get("launches", [None])[-1], sort_keys=True)
    views, _ = gather_objects([(socket.gethostname(), seen)])
    apart = [f"rank {r} on {host}" for r, (host, view) in enumerate(views) if view != views[0][1]]
    if not apart:
        return None
    return (
        f"the processes of this run do not share one run folder: {some_of(apart)} "
        f"{'does' if len(apart) == 1 else 'do'} not see the run.json rank 0 "
        f"wrote in {run_folder(phase)} (another disk at that path); every rank's part of a checkpoint must land in "
        "one folder: put --output_dir on a file system every node shares (training.save_on_each_node, a copy on "
        "each node's own disk, is not supported: such checkpoints cannot be resumed as one)"
    )


def read_record(run_dir: Path, say: Callable[[str], None], write: bool) -> dict | None:
    """``run.json``, or None without one. An unreadable one holds the run's launch history, which a
    new record would lose: it is kept aside under a name of its own, with one line, and the run
    goes on as a run without a record (a new one starts its history)."""
    path = run_dir / RECORD
    if not path.is_file():
        return None
    record = read_json(path)
    if (
        isinstance(record, dict)
        and isinstance(record.get("config"), dict)
        and isinstance(record.get("launches"), list)
    ):
        return record
    aside = path.with_name(f"{RECORD}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
    if write:
        os.replace(path, aside)
    say(
        f"{path} is unreadable (not the JSON record of a run's config and launches): kept as {aside.name}; a new "
        f"{RECORD} starts the launch history"
    )
    return None


def record_kept(run_dir: Path, phase: int | None, kept: dict[str, Any]) -> None:
    """Write into ``run.json``'s config the training settings a resume kept from its checkpoint
    instead of the command's (phase ``phase`` of a multi-phase run), so that the record says
    what the run trains with and the next launch names the difference."""
    record = read_json(run_dir / RECORD)
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        return
    section = record["config"] if phase is None else record["config"]["phases"][phase].setdefault("overrides", {})
    section.setdefault("training", {}).update(kept)
    atomic_write_text(run_dir / RECORD, json.dumps(record, indent=2, default=str))


def _started(folder: Path) -> bool:
    return any((folder / name).exists() for name in PROGRESS) or bool(checkpoint_folders(folder))


def _record(
    run_dir: Path, config: dict, record: dict | None, how: str, write: bool, data: dict[str, str] | None = None
) -> None:
    if not write:
        return
    from crystal_grpo.distributed import launch_command

    run_id = (record or {}).get("run_id") or (how == "resume" and marked_run(run_dir)) or uuid.uuid4().hex
    launches = (record or {}).get("launches", [])
    launches.append(
        {
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": socket.gethostname(),
            "how": how,
            "command": launch_command(),
            **({"data": data} if data else {}),
        }
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"run_id": run_id, "config": config, "launches": launches}
    atomic_write_text(run_dir / RECORD, json.dumps(record, indent=2, default=str))


def as_record(cfg: Any) -> dict:
    """A config as ``run.json`` keeps it (JSON values only)."""
    return json.loads(json.dumps(to_dict(cfg), default=str))
