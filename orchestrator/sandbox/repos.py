"""Repositories on this host: a dataset row names a repository at a commit, and the
sandbox's /workspace is that commit checked out, with a history of that commit and its
ancestors only (docs/datasets.md).

Nothing is built per commit but files. Under ``<repos_dir>/<name>/``:

- ``store.git``: a bare repository of everything fetched from the registered source,
  branches and tags; no sandbox ever sees it.
- ``layers/<commit>/``: the overlay layer a commit adds. The first commit of a repository
  materialised on this host is a *base* layer: its whole tree and a ``.git`` whose one pack
  holds every object reachable from the commit. A later commit whose nearest materialised
  ancestor is B is a layer on B's stack: the files whose mode or contents differ from B's
  (a whiteout for each path B has and the commit does not), and in ``.git`` its ref, its
  index and one pack of the objects reachable from it and not from B. Packs are named by
  git by their content and never delta against another pack, so each is whole.
- ``commits/<commit>.json``: the commit's layer record (its base, its depth, its own
  layer's bytes); the file's mtime is its last use, for the least-recently-used eviction
  within ``repo_layers_mb``.

A sandbox's /workspace is an overlay whose lower layers are its commit's stack (top first:
workspace.py), so a commit costs the files that changed since its base and the objects
that are new, while every sandbox still sees exactly its commit. Each pack is checked
against ``git rev-list --objects`` before a layer is kept: an object reachable only from a
later commit, another branch or a tag never reaches a sandbox.

Concurrent materialisations of one commit on a host (threads or processes) build it once:
an exclusive ``flock`` per commit; the store's fetches hold one per repository.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.config import Settings
from orchestrator.observability.logging import get_logger
from orchestrator.sandbox.backend import RepoSetup

log = get_logger(__name__)

AGENT_UID = 1000
AGENT_GID = 1000
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
"""A commit as rows name it: a full SHA-1 (a branch or a short id could change meaning)."""
REPO_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
MOUNT_OPTIONS_ROOM = 3000
"""Bytes of an overlay's mount options its lower layers may take: the kernel reads the
options as one page (4096 bytes), and the upper and work directories need the rest. A
commit whose nearest materialised ancestor's stack is as deep as fits gets a base layer of
its own (:meth:`HostRepos.max_depth`)."""
IN_USE_GRACE_S = 900.0
"""A commit used this recently is never evicted: a sandbox being made may be about to
mount it (its layers are read from the record before the mount exists)."""
GIT_TIMEOUT_S = 900
# Transports git may use: never ext:: (which runs a command) or another helper.
ALLOWED_PROTOCOLS = "file:git:http:https:ssh"

# A fixed identity, and no system or user configuration: a global config could add hooks,
# templates or fetch settings that leak refs into a repository a sandbox sees.
_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "orchestrator",
    "GIT_AUTHOR_EMAIL": "orchestrator@localhost",
    "GIT_COMMITTER_NAME": "orchestrator",
    "GIT_COMMITTER_EMAIL": "orchestrator@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_ALLOW_PROTOCOL": ALLOWED_PROTOCOLS,
    "LC_ALL": "C",
}
_SAFE_CONFIG = "[safe]\n\tdirectory = *\n"

SOURCE_HEAD = "refs/orchestrator/source-head"
"""Where the store keeps the commit the source's HEAD was at the last fetch."""
MODE_FILE = "100644"
MODE_EXECUTABLE = "100755"
MODE_SYMLINK = "120000"
MODE_GITLINK = "160000"
MODE_TREE = "040000"


class RepoError(RuntimeError):
    """A repository operation failed on this host (the machinery's fault, or the source's)."""


class RepoSourceError(RepoError, ValueError):
    """The source is not a git repository, or a URL the operator does not allow."""


class UnknownCommit(RepoError, LookupError):
    """The commit is not in the repository (after fetching from its source again)."""


def git_environment(global_config: Path) -> dict[str, str]:
    """The environment every git command of ours runs in: the host user's git settings
    and ``GIT_*`` variables left out, a fixed identity, safe transports only, and
    ``global_config`` as the one config (it trusts repositories other users own:
    ``safe.directory`` is honoured only there, and the upload-pack of a local fetch does
    not see ``-c`` options)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(_GIT_ENV)
    env["GIT_CONFIG_GLOBAL"] = str(global_config)
    return env


def is_url(source: str) -> bool:
    """Whether ``source`` is a URL (or scp-like ``host:path``), not a local path."""
    return "://" in source or (not source.startswith("/") and ":" in source.split("/")[0])


_SCP_LIKE = re.compile(r"(?:[\w.-]+@)?[\w.-]+:(?!:).*")


def _transport(source: str) -> str | None:
    """The transport a URL uses: its scheme, ``ssh`` for ``[user@]host:path``, None for
    what git would hand to a remote helper (``ext::``, ``fd::``, ...)."""
    if "://" in source:
        return source.split("://", 1)[0]
    return "ssh" if _SCP_LIKE.fullmatch(source) else None


def check_source(source: str, allowed_urls: list[str]) -> str:
    """``source`` as it is stored: an absolute local path that exists (a repository, or a
    git bundle: ``*.bundle``), or a URL that
    starts with one of ``allowed_urls`` (none are allowed unless the operator lists
    them: ORCH_REPO_ALLOWED_URLS). :class:`RepoSourceError` says which and why."""
    source = source.strip()
    if not source:
        raise RepoSourceError("the repository source is empty")
    if is_url(source):
        transport = _transport(source)
        if transport not in ALLOWED_PROTOCOLS.split(":"):
            raise RepoSourceError(
                f"the source {source!r} uses a transport git may not use here (allowed: "
                f"{ALLOWED_PROTOCOLS.replace(':', ', ')})"
            )
        if not any(source.startswith(prefix) for prefix in allowed_urls if prefix):
            listed = ", ".join(allowed_urls) if allowed_urls else "none"
            raise RepoSourceError(
                f"the URL {source!r} is not allowed: it must start with one of the prefixes "
                f"in ORCH_REPO_ALLOWED_URLS (allowed now: {listed})"
            )
        return source
    path = Path(source).expanduser().resolve()
    if not (path.is_dir() or (path.is_file() and path.suffix == ".bundle")):
        raise RepoSourceError(
            f"the source {source!r} is not a directory (a git repository) or a .bundle file"
        )
    return str(path)


def check_commit(commit: str) -> str:
    """``commit`` if it is a full 40-character lowercase hex commit id."""
    if not isinstance(commit, str) or not COMMIT_RE.fullmatch(commit):
        raise ValueError(
            f"the commit must be a full 40-character hex commit id (got {commit!r}): a "
            "branch, tag or short id can mean another commit tomorrow"
        )
    return commit


class CommitLayer(BaseModel):
    """The record of the layer one commit adds (``commits/<commit>.json``)."""

    model_config = ConfigDict(frozen=True)

    commit: str
    base: str | None = Field(description="The commit whose stack this layer sits on; None: a base.")
    depth: int = Field(description="Layers in this commit's stack, its own included.")
    bytes: int = Field(description="Disk its own layer takes (files, whiteouts, pack, index).")
    files: int = Field(description="Files, links and whiteouts its own layer holds.")
    ms: float = Field(0.0, description="How long building the layer took.")


@dataclass(frozen=True)
class Materialised:
    """A commit ready on this host: its lower layers, top first, and whether this call
    built its own layer (False: it was there)."""

    commit: str
    lowers: list[Path]
    built: bool
    layer: CommitLayer


@dataclass(frozen=True)
class _Entry:
    mode: str
    sha: str


class HostRepos:
    """The repositories of this host under ``root`` (``settings.repos_dir``)."""

    def __init__(self, root: Path, *, budget_bytes: int, allowed_urls: list[str]) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.allowed_urls = allowed_urls

    @classmethod
    def of(cls, settings: Settings) -> HostRepos:
        """This host's repositories as the deployment's settings place and bound them."""
        return cls(
            settings.repos_dir,
            budget_bytes=settings.repo_layers_mb << 20,
            allowed_urls=settings.repo_url_prefixes,
        )

    # -- paths -----------------------------------------------------------------------------

    def _dir(self, name: str) -> Path:
        if not REPO_NAME_RE.fullmatch(name):
            raise RepoSourceError(f"invalid repository name {name!r}")
        return self.root / name

    def store(self, name: str) -> Path:
        """The bare repository holding everything fetched for ``name`` on this host."""
        return self._dir(name) / "store.git"

    def layer_dir(self, name: str, commit: str) -> Path:
        """The overlay layer ``commit`` adds (a directory laid out as /workspace)."""
        return self._dir(name) / "layers" / check_commit(commit)

    def _record_path(self, name: str, commit: str) -> Path:
        return self._dir(name) / "commits" / f"{check_commit(commit)}.json"

    @contextlib.contextmanager
    def lock(self, name: str, what: str) -> Iterator[None]:
        """Exclusive, across this host's threads and processes: ``what`` of repository
        ``name`` (a commit's build, the store's fetches, a set-up image's build)."""
        locks = self._dir(name) / "locks"
        locks.mkdir(parents=True, exist_ok=True, mode=0o700)
        with (locks / f"{what}.lock").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _git_env(self, name: str) -> Iterator[dict[str, str]]:
        config = self._dir(name) / "gitconfig"
        if not config.exists():
            config.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            config.write_text(_SAFE_CONFIG)
        yield git_environment(config)

    # -- the store -------------------------------------------------------------------------

    def fetch(self, name: str, source: str) -> tuple[str, int]:
        """Bring the store of ``name`` up to date with ``source`` (made on first use);
        returns the commit the source's HEAD is and how many commits the store holds."""
        source = check_source(source, self.allowed_urls)
        with self.lock(name, "store"), self._git_env(name) as env:
            self._fetch(name, source, env)
            store = self.store(name)
            head = _git(["rev-parse", "--verify", "--quiet", SOURCE_HEAD], store, env, check=False)
            count = _git(["rev-list", "--all", "--count"], store, env)
        return head.stdout.strip(), int(count.stdout.strip() or 0)

    def _fetch(self, name: str, source: str, env: dict[str, str], *extra: str) -> None:
        store = self.store(name)
        recorded = self._dir(name) / "source"
        if (store / "HEAD").exists() and _read(recorded) != source:
            # Registered again from another source: its refs and objects are not this one's
            # (layers stay: a commit id names the same tree and history from any source).
            shutil.rmtree(store)
        if not (store / "HEAD").exists():
            recorded.write_text(source)
            scratch = Path(tempfile.mkdtemp(prefix=".store-", dir=store.parent))
            _git(["init", "--quiet", "--bare", "--template=", str(scratch)], store.parent, env)
            scratch.rename(store)
        refspecs = [
            "+refs/heads/*:refs/heads/*",
            "+refs/tags/*:refs/tags/*",
            f"+HEAD:{SOURCE_HEAD}",
            *extra,
        ]
        started = time.monotonic()
        _git(
            ["fetch", "--quiet", "--prune", "--no-write-fetch-head", source, *refspecs],
            store,
            env,
            what=f"fetch {name} from {source}",
        )
        log.info("repo.fetched", repo=name, ms=round((time.monotonic() - started) * 1000, 1))

    def has_commit(self, name: str, source: str, commit: str) -> bool:
        """Whether ``commit`` is a commit of ``name``: asked of the store, fetched from the
        source first when the store lacks it (new commits since the last fetch)."""
        check_commit(commit)
        source = check_source(source, self.allowed_urls)
        if self._stored(name, source, commit):
            return True
        with self.lock(name, "store"), self._git_env(name) as env:
            if self._stored(name, source, commit):
                return True
            self._fetch(name, source, env)
            if self._stored(name, source, commit):
                return True
            # Not on a branch or a tag: a server may still give it when asked by id.
            with contextlib.suppress(RepoError):
                self._fetch(name, source, env, commit)
        return self._stored(name, source, commit)

    def _stored(self, name: str, source: str, commit: str) -> bool:
        store = self.store(name)
        if not (store / "HEAD").exists() or _read(self._dir(name) / "source") != source:
            return False
        with self._git_env(name) as env:
            proc = _git(["cat-file", "-t", commit], store, env, check=False)
        return proc.returncode == 0 and proc.stdout.strip() == "commit"

    def committed_at(self, name: str, commit: str) -> float:
        """The commit's committer time (Unix seconds); 0 when the store cannot tell."""
        with self._git_env(name) as env:
            shown = _git(["show", "-s", "--format=%ct", commit], self.store(name), env, check=False)
        try:
            return float(shown.stdout.strip())
        except ValueError:
            return 0.0

    # -- set-up ----------------------------------------------------------------------------

    def fingerprint(self, name: str, commit: str, setup: RepoSetup) -> str:
        """What decides the set-up image of ``commit`` (in the store already): the set-up
        itself, the object id of each of its ``deps`` at the commit, and the wheelhouse's
        file names and sizes. Commits that agree on them share an image."""
        with self._git_env(name) as env:
            listed = _git(
                ["ls-tree", "-r", "--full-tree", commit, "--", *setup.deps],
                self.store(name),
                env,
                what=f"list the set-up files of {commit[:12]}",
            ).stdout
        blobs = sorted(line.split(None, 3)[2:] for line in listed.splitlines() if line.strip())
        wheels: list[tuple[str, int]] = []
        if setup.wheelhouse:
            house = Path(setup.wheelhouse)
            if not house.is_dir():
                raise RepoError(f"the wheelhouse {house} is not a directory on this host")
            wheels = sorted((p.name, p.stat().st_size) for p in house.iterdir() if p.is_file())
        canonical = json.dumps(
            {"setup": setup.model_dump(mode="json"), "deps": blobs, "wheels": wheels},
            sort_keys=True,
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    def export_files(self, name: str, commit: str, paths: list[str], dest: Path) -> list[str]:
        """Write each of ``paths`` that ``commit`` has under ``dest`` (at its path);
        returns those written."""
        with self._git_env(name) as env:
            entries = _tree_entries(self.store(name), env, commit)
            wanted = [
                (p, entries[p]) for p in paths if p in entries and entries[p].mode != MODE_TREE
            ]
            for path, _ in wanted:
                (dest / path).parent.mkdir(parents=True, exist_ok=True)
            _write_blobs(self.store(name), env, dest, wanted)
        return [p for p, _ in wanted]

    # -- commits ---------------------------------------------------------------------------

    def materialise(
        self,
        name: str,
        source: str,
        commit: str,
        *,
        in_use: Callable[[], set[Path]] | None = None,
    ) -> Materialised:
        """``commit`` of ``name`` ready to mount on this host: built when it is not (its
        store fetched first when it lacks the commit), then other commits evicted past the
        budget, never one whose layer is in ``in_use()`` (the lower layers of this host's
        sandboxes). :class:`UnknownCommit` when the source has no such commit."""
        check_commit(commit)
        record = self.layer_record(name, commit)
        if record is not None:
            return self._use(name, record, built=False)
        if not self.has_commit(name, source, commit):
            raise UnknownCommit(f"repository {name!r} has no commit {commit}")
        with self.lock(name, commit):
            record = self.layer_record(name, commit)
            built = record is None
            if record is None:
                record = self._build(name, commit)
        done = self._use(name, record, built=built)
        if built:
            self.evict(name, in_use=in_use)
        return done

    def layer_record(self, name: str, commit: str) -> CommitLayer | None:
        """The record of ``commit``'s layer, None when it is not materialised here."""
        try:
            raw = self._record_path(name, commit).read_text()
        except FileNotFoundError:
            return None
        return CommitLayer.model_validate_json(raw)

    def lowers(self, name: str, commit: str) -> list[Path]:
        """``commit``'s stack of layers, top first; :class:`RepoError` when a layer of it
        is not on this host (materialise it first)."""
        lowers: list[Path] = []
        current: str | None = commit
        while current is not None:
            record = self.layer_record(name, current)
            if record is None:
                raise RepoError(f"commit {current[:12]} of {name!r} is not materialised here")
            lowers.append(self.layer_dir(name, current) / "tree")
            current = record.base
        return lowers

    def _use(self, name: str, record: CommitLayer, *, built: bool) -> Materialised:
        path = self._record_path(name, record.commit)
        # The stack's records are touched too: a base in use is never the least recent.
        lowers = self.lowers(name, record.commit)
        now = time.time()
        for lower in lowers:
            os.utime(self._record_path(name, lower.parent.name), (now, now))
        os.utime(path, (now, now))
        return Materialised(commit=record.commit, lowers=lowers, built=built, layer=record)

    def max_depth(self, name: str) -> int:
        """How many layers a stack of ``name`` may have: as many of its layers' paths as
        fit in an overlay's mount options (MOUNT_OPTIONS_ROOM), 2 at least."""
        longest = len(str(self.layer_dir(name, "0" * 40) / "tree")) + 1
        return max(2, MOUNT_OPTIONS_ROOM // longest)

    def _base_for(self, name: str, commit: str, env: dict[str, str]) -> CommitLayer | None:
        """The nearest materialised ancestor of ``commit`` (by commit date), when its stack
        has room for one more layer; None: ``commit`` gets a base layer."""
        ready = {
            p.stem: p for p in (self._dir(name) / "commits").glob("*.json") if p.stem != commit
        }
        if not ready:
            return None
        proc = subprocess.Popen(
            ["git", "rev-list", commit],
            cwd=self.store(name),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                ancestor = line.strip()
                if ancestor in ready and ancestor != commit:
                    record = self.layer_record(name, ancestor)
                    if record is not None:
                        return record if record.depth < self.max_depth(name) else None
        finally:
            proc.kill()
            proc.wait()
        return None

    def _build(self, name: str, commit: str) -> CommitLayer:
        started = time.monotonic()
        layers = self._dir(name) / "layers"
        layers.mkdir(parents=True, exist_ok=True, mode=0o755)
        (self._dir(name) / "commits").mkdir(parents=True, exist_ok=True, mode=0o700)
        store = self.store(name)
        # Readable by the sandbox's user through the overlay: the layers' path must be
        # searchable (the repository's own directory holds nothing else a sandbox sees).
        for directory in (self.root, self._dir(name), layers):
            directory.chmod(0o755)
        scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=layers))
        try:
            with self._git_env(name) as env:
                base = self._base_for(name, commit, env)
                tree = scratch / "tree"
                tree.mkdir()
                files = _write_tree(store, env, tree, commit, base.commit if base else None)
                _write_git(store, env, tree, commit, base.commit if base else None)
            _chown_tree(tree)
            size = _disk_bytes(scratch)
            record = CommitLayer(
                commit=commit,
                base=base.commit if base else None,
                depth=(base.depth + 1) if base else 1,
                bytes=size,
                files=files,
                ms=round((time.monotonic() - started) * 1000, 1),
            )
            final = self.layer_dir(name, commit)
            if final.exists():  # a build that died before writing its record
                shutil.rmtree(final)
            scratch.rename(final)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        path = self._record_path(name, commit)
        partial = path.with_suffix(".tmp")
        partial.write_text(record.model_dump_json())
        partial.rename(path)
        log.info(
            "repo.materialised",
            repo=name,
            commit=commit,
            base=record.base,
            depth=record.depth,
            bytes=record.bytes,
            files=record.files,
            ms=record.ms,
        )
        return record

    # -- eviction --------------------------------------------------------------------------

    def usage(self, name: str | None = None) -> dict[str, list[CommitLayer]]:
        """Every materialised commit here, by repository (or of ``name`` only)."""
        found: dict[str, list[CommitLayer]] = {}
        if not self.root.is_dir():
            return found
        names = [name] if name else sorted(p.name for p in self.root.iterdir() if p.is_dir())
        for repo in names:
            records = []
            for path in sorted((self._dir(repo) / "commits").glob("*.json")):
                with contextlib.suppress(FileNotFoundError, ValueError):
                    records.append(CommitLayer.model_validate_json(path.read_text()))
            found[repo] = records
        return found

    def evict(self, name: str, *, in_use: Callable[[], set[Path]] | None = None) -> list[str]:
        """Remove the least recently used commits of ``name`` whose layers no other commit
        stands on, until its layers fit the budget; never one used in the last
        ``IN_USE_GRACE_S`` or whose layer is in ``in_use()``. Returns the evicted commits."""
        evicted: list[str] = []
        with self.lock(name, "evict"):
            records = {r.commit: r for r in self.usage(name).get(name, [])}
            total = sum(r.bytes for r in records.values())
            now = time.time()
            used = in_use() if in_use is not None and total > self.budget_bytes else set()
            while total > self.budget_bytes:
                bases = {r.base for r in records.values() if r.base}
                candidates = []
                for commit in records:
                    if commit in bases:
                        continue
                    try:
                        last = self._record_path(name, commit).stat().st_mtime
                    except FileNotFoundError:
                        continue
                    layer = self.layer_dir(name, commit) / "tree"
                    if now - last < IN_USE_GRACE_S or layer in used:
                        continue
                    candidates.append((last, commit))
                if not candidates:
                    break
                _, victim = min(candidates)
                with self.lock(name, victim):
                    self._record_path(name, victim).unlink(missing_ok=True)
                    shutil.rmtree(self.layer_dir(name, victim), ignore_errors=True)
                total -= records.pop(victim).bytes
                evicted.append(victim)
        if evicted:
            log.info("repo.evicted", repo=name, commits=len(evicted), left_bytes=total)
        return evicted

    def remove(self, name: str) -> None:
        """Remove everything of ``name`` on this host (its store and layers)."""
        shutil.rmtree(self._dir(name), ignore_errors=True)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


# --- building a layer ------------------------------------------------------------------------


def _git(
    args: list[str],
    cwd: Path,
    env: dict[str, str],
    *,
    check: bool = True,
    what: str = "",
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=env,
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=GIT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise RepoError(f"{what or 'git ' + args[0]} took over {GIT_TIMEOUT_S} s") from exc
    if check and proc.returncode != 0:
        raise RepoError(
            f"{what or 'git ' + ' '.join(args[:2])} failed (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-500:]}"
        )
    return proc


def _tree_entries(store: Path, env: dict[str, str], commit: str) -> dict[str, _Entry]:
    """Every path of ``commit``'s tree (directories too) with its mode and object id."""
    out = subprocess.run(
        ["git", "ls-tree", "-r", "-t", "-z", "--full-tree", commit],
        cwd=store,
        env=env,
        capture_output=True,
        check=True,
        timeout=GIT_TIMEOUT_S,
    ).stdout
    entries: dict[str, _Entry] = {}
    for item in out.split(b"\0"):
        if not item:
            continue
        meta, _, path = item.partition(b"\t")
        mode, _kind, sha = meta.decode().split(" ")
        entries[os.fsdecode(path)] = _Entry(mode, sha)
    return entries


def _write_tree(store: Path, env: dict[str, str], tree: Path, commit: str, base: str | None) -> int:
    """Write into ``tree`` what ``commit`` has that ``base``'s stack does not show (all of
    it without a base), with a whiteout where ``base`` has a path ``commit`` has not.
    Returns how many entries were written."""
    wanted = _tree_entries(store, env, commit)
    before = _tree_entries(store, env, base) if base else {}
    written = 0
    for path, entry in before.items():
        if path in wanted and (wanted[path].mode == MODE_TREE) == (entry.mode == MODE_TREE):
            continue
        parent = path.rpartition("/")[0]
        # Under a directory that is gone too (its whiteout hides this) or that became a
        # file (which hides it): nothing to write.
        if parent and (parent not in wanted or wanted[parent].mode != MODE_TREE):
            continue
        if path in wanted:
            continue  # a file that became a directory or back: the new one is written below
        target = tree / path
        target.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        written += 1
    blobs: list[tuple[str, _Entry]] = []
    for path, entry in wanted.items():
        old = before.get(path)
        if old == entry and entry.mode != MODE_TREE:
            continue
        target = tree / path
        if entry.mode == MODE_TREE:
            if old is None or old.mode != MODE_TREE:
                target.mkdir(parents=True, exist_ok=True)
            continue
        if entry.mode == MODE_GITLINK:
            target.mkdir(parents=True, exist_ok=True)  # a submodule: empty, as git checks out
            written += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        blobs.append((path, entry))
    written += _write_blobs(store, env, tree, blobs)
    return written


def _write_blobs(
    store: Path, env: dict[str, str], tree: Path, blobs: list[tuple[str, _Entry]]
) -> int:
    """Write each blob at its path through one ``git cat-file --batch``."""
    if not blobs:
        return 0
    request = "".join(f"{entry.sha}\n" for _, entry in blobs).encode()
    with tempfile.TemporaryFile() as ids:
        ids.write(request)
        ids.seek(0)
        proc = subprocess.Popen(
            ["git", "cat-file", "--batch"],
            cwd=store,
            env=env,
            stdin=ids,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert proc.stdout is not None
        try:
            for path, entry in blobs:
                header = proc.stdout.readline().split()
                if len(header) != 3 or header[1] != b"blob":
                    raise RepoError(f"the store has no blob {entry.sha} for {path}")
                data = proc.stdout.read(int(header[2]))
                proc.stdout.read(1)  # the newline after each object
                target = tree / path
                if entry.mode == MODE_SYMLINK:
                    target.symlink_to(os.fsdecode(data))
                    continue
                target.write_bytes(data)
                target.chmod(0o755 if entry.mode == MODE_EXECUTABLE else 0o644)
        finally:
            proc.stdout.close()
            if proc.wait(timeout=GIT_TIMEOUT_S) != 0:
                raise RepoError("git cat-file --batch failed")
    return len(blobs)


def _write_git(store: Path, env: dict[str, str], tree: Path, commit: str, base: str | None) -> None:
    """The layer's ``.git``: its ref and index, one pack of the objects reachable from
    ``commit`` and not from ``base`` (every one without a base), and without a base the
    rest of a repository (HEAD, config, empty refs). Nothing else: no remotes, tags,
    reflogs, hooks or other refs."""
    git_dir = tree / ".git"
    packs = git_dir / "objects" / "pack"
    packs.mkdir(parents=True)
    (git_dir / "refs" / "heads").mkdir(parents=True)
    if base is None:
        (git_dir / "refs" / "tags").mkdir()
        (git_dir / "objects" / "info").mkdir()
        (git_dir / "HEAD").write_text("ref: refs/heads/main\n")
        (git_dir / "config").write_text(
            "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n"
        )
    revisions = f"{commit}\n" + (f"^{base}\n" if base else "")
    # Whole packs only (no --thin): a pack never stands on objects of another layer's.
    made = _git(
        ["pack-objects", "--revs", "--quiet", str(packs / "pack")],
        store,
        env,
        stdin=revisions,
        what=f"pack the objects of {commit[:12]}",
    ).stdout.strip()
    in_pack = _pack_objects(store, env, packs / f"pack-{made}.idx")
    # What the pack may hold: objects reachable from the commit. The increment's own list
    # first (cheap); pack-objects also takes some the base reaches at the edge, which the
    # whole history of the commit is asked about.
    extra = in_pack - _reachable(store, env, commit, base)
    if extra and base is not None:
        extra -= _reachable(store, env, commit, None)
    if extra:
        raise RepoError(
            f"the pack for {commit[:12]} holds {len(extra)} objects not reachable from it "
            f"(e.g. {sorted(extra)[0]}): refusing a layer that could show later history"
        )
    (git_dir / "refs" / "heads" / "main").write_text(f"{commit}\n")
    _git(
        ["read-tree", commit],
        store,
        {**env, "GIT_INDEX_FILE": str(git_dir / "index")},
        what=f"write the index of {commit[:12]}",
    )


def _reachable(store: Path, env: dict[str, str], commit: str, base: str | None) -> set[str]:
    """Objects reachable from ``commit`` (and not from ``base``, when given)."""
    listed = _git(["rev-list", "--objects", commit, *([f"^{base}"] if base else [])], store, env)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def _pack_objects(store: Path, env: dict[str, str], index: Path) -> set[str]:
    with index.open("rb") as handle:
        out = subprocess.run(
            ["git", "show-index"],
            cwd=store,
            env=env,
            stdin=handle,
            capture_output=True,
            text=True,
            check=True,
            timeout=GIT_TIMEOUT_S,
        ).stdout
    return {line.split()[1] for line in out.splitlines() if line.strip()}


def _chown_tree(tree: Path) -> None:
    """The sandbox's user owns the tree (its writes copy up into its own layer); whiteouts
    stay root's, as overlay makes them."""
    for directory, dirnames, filenames in os.walk(tree):
        os.lchown(directory, AGENT_UID, AGENT_GID)
        os.chmod(directory, 0o755)  # noqa: PTH101, S103 (a str from os.walk; read by all)
        for entry in (*dirnames, *filenames):
            path = os.path.join(directory, entry)  # noqa: PTH118
            info = os.lstat(path)
            if stat.S_ISCHR(info.st_mode):
                continue
            if not stat.S_ISDIR(info.st_mode):
                os.lchown(path, AGENT_UID, AGENT_GID)


def _disk_bytes(path: Path) -> int:
    total = 0
    for directory, dirnames, filenames in os.walk(path):
        for entry in (*dirnames, *filenames):
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(directory, entry)).st_blocks * 512  # noqa: PTH118
        total += os.lstat(directory).st_blocks * 512
    return total
