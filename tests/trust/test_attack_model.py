"""An attacker model-checker over the trust kernel (issue 41): hypothesis drives random sequences of
every file-level edit a keyless attacker can make to two signed run stores, a vault and a fleet
registry (tests/support/kernel_world.py, trained on 3 gloo ranks), with an operator's commands in between,
and checks four invariants against the untouched world after every step:

1. no checkpoint's level is higher than in the untouched store (trusted > verified > suspect);
2. no operator command deletes a vault copy that the untouched vault's policy keeps (latest-good
   included);
3. no conviction is cleared: the convicted device never starts, the checkpoints it made suspect
   stay below verified;
4. every command ends with exit 0, 1 or 2, without a traceback, within 30 s.

CI runs a fixed number of examples with a fixed seed; ``CERTCKPT_ATTACK_EXAMPLES=N`` (and
``CERTCKPT_ATTACK_STEPS``) runs it for as long as you like
(``scripts/attack-model.sh``). Every counterexample found becomes a named test in
tests/trust/test_trust_kernel.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from certckpt.errors import CertckptError
from tests.support.kernel_world import World, cli, held, levels, start, unsigned_entry

pytestmark = pytest.mark.slow

RANK = {"suspect": 0, "verified": 1, "trusted": 2}
RUNS = ("clean", "prior", "det", "solo")
STORES = (*RUNS, "vault", "fleet")
EXAMPLES = int(os.environ.get("CERTCKPT_ATTACK_EXAMPLES", "40"))
STEPS = int(os.environ.get("CERTCKPT_ATTACK_STEPS", "10"))
LONG = "CERTCKPT_ATTACK_EXAMPLES" in os.environ  # a long run explores; CI replays the same sequences
COMMAND_SECONDS = 30.0
INDEX = st.integers(0, 1 << 16)  # which file: taken modulo what the store holds when the move runs
KEY_PATHS = {
    f"_ledger/{name}"
    for name in (
        "genesis.json",
        "chains",
        "events",
        "checkpoints",
        "incidents",
        "revocations",
        "placements",
        "holdings",
        "sources",
        "convictions",
        "stores",
        "vault.json",
    )
}


def _files(root: str) -> list[str]:
    """Every file and directory an attacker could touch in a store (relative paths, sorted)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for n in sorted(dirnames) + sorted(filenames):
            out.append(n if rel == "." else os.path.join(rel, n))
    return sorted(out)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


class Attacker(RuleBasedStateMachine):
    """One attack sequence over a fresh copy of the world; ``world``, ``pg`` and ``untouched`` are set
    by the test before the machine runs."""

    world: World
    pg: dict
    untouched: dict[str, dict[str, str]]
    releasable: set[str]  # vault copies the untouched policy (--keep-last 2) lets go
    runs = 0
    moves = 0  # steps checked, over every sequence
    answered: set[str] = set()  # commands that exited 0 at least once: the harness is not vacuous

    @initialize()
    def fresh_world(self) -> None:
        Attacker.runs += 1
        self.world.restore()
        os.environ["CERTCKPT_STATE_DIR"] = os.path.join(self.world.live, "..", f"state-{Attacker.runs}")
        self.log: list[str] = []
        self.starts = 0
        self.operator("status", "clean")  # the operator has read the stores before the attack
        self.operator("status", "det")
        self.operator("status", "vault")
        self.operator("latest-good", "clean")

    # --- the operator ------------------------------------------------------------------------------

    def operator(self, *args: str) -> None:
        # the command's words stay words ("vault prune", "fleet ls"); a store's name after them is its path
        words = 2 if args[0] in ("vault", "fleet") else 1
        argv = [*args[:words], *(self.world.path(a) if a in STORES else a for a in args[words:])]
        if args[0] == "fleet":
            argv = [*argv, "--fleet", self.world.path("fleet")]
        before = held(self.world) if "prune" in args or "promote" in args else None
        t0 = time.monotonic()
        r = cli(*argv)
        took = time.monotonic() - t0
        self.log.append(f"{' '.join(args)} -> {r.exit_code}")
        assert r.exit_code in (0, 1, 2), f"{args}: exit {r.exit_code}\n{r.output}\n{r.exception!r}"
        assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), (
            f"{args}: {r.exception!r}\n{r.output}"
        )
        assert took < COMMAND_SECONDS, f"{args} took {took:.1f} s"
        if r.exit_code == 0:
            Attacker.answered.add(" ".join(args[:words]))
        if before is not None:
            deleted = before - held(self.world)
            assert deleted <= self.releasable, f"{args} deleted {deleted - self.releasable}: {r.output}"

    @rule(cmd=st.sampled_from(["status", "latest-good", "latest-good-verified"]), store=st.sampled_from(RUNS))
    def read(self, cmd: str, store: str) -> None:
        if cmd == "latest-good-verified":
            self.operator("latest-good", store, "--accept", "verified")
        else:
            self.operator(cmd, store)

    @rule()
    def prune(self) -> None:
        self.operator("vault", "prune", "vault", "--keep-last", "2", "--apply")

    @rule()
    def promote(self) -> None:
        self.operator("vault", "promote", "clean", "vault")

    @rule()
    def fleet_ls(self) -> None:
        self.operator("fleet", "ls")

    @rule()
    def start_on_the_convicted_device(self) -> None:
        self.starts += 1
        where = os.path.join(self.world.live, "..", f"newrun-{Attacker.runs}-{self.starts}")
        assert start(self.world, self.pg, "gpu-x", where) is not None, "a run started on the convicted device"

    # --- the attacker ------------------------------------------------------------------------------

    def _target(self, store: str, index: int, key: bool) -> str | None:
        """A file or directory of the store: with ``key``, one that evidence hangs on (the genesis, the
        chains, a writer's chain, the records that convict, block or commit), else any. Every draw is
        a rule argument: what a move draws never depends on what the store holds now (names with
        timestamps differ between replays, and hypothesis must see the same draws)."""
        files = _files(self.world.path(store))
        hot = [f for f in files if f in KEY_PATHS or f.startswith(("_ledger/chains/", "_ledger/events/"))]
        among = hot if key and hot else files
        return os.path.join(self.world.path(store), among[index % len(among)]) if among else None

    @rule(store=st.sampled_from(STORES), index=INDEX, key=st.booleans())
    def delete(self, store: str, index: int, key: bool) -> None:
        target = self._target(store, index, key)
        if target:
            self.log.append(f"delete {target}")
            _remove(target)

    @rule(store=st.sampled_from(STORES), index=INDEX, key=st.booleans(), keep=st.integers(0, 400))
    def truncate(self, store: str, index: int, key: bool, keep: int) -> None:
        target = self._target(store, index, key)
        if target and os.path.isfile(target) and not os.path.islink(target):
            self.log.append(f"truncate {target} {keep}")
            os.truncate(target, min(keep, os.path.getsize(target)))

    @rule(store=st.sampled_from(STORES), index=INDEX, key=st.booleans(), extra=st.binary(min_size=1, max_size=64))
    def append(self, store: str, index: int, key: bool, extra: bytes) -> None:
        target = self._target(store, index, key)
        if target and os.path.isfile(target) and not os.path.islink(target):
            self.log.append(f"append {target}")
            with open(target, "ab") as f:
                f.write(extra)

    @rule(
        store=st.sampled_from(STORES),
        index=INDEX,
        key=st.booleans(),
        suffix=st.sampled_from(["x", ".json", "0", "@9.json"]),
        rename=st.booleans(),
    )
    def rename_or_duplicate(self, store: str, index: int, key: bool, suffix: str, rename: bool) -> None:
        target = self._target(store, index, key)
        if not target or not os.path.lexists(target):
            return
        dest = target.removesuffix(".json") + suffix
        if os.path.lexists(dest):
            return
        self.log.append(f"{'rename' if rename else 'duplicate'} {target} {dest}")
        with contextlib.suppress(OSError, shutil.Error):  # a FIFO cannot be copied: no duplicate
            if rename:
                os.rename(target, dest)
            else:
                (shutil.copytree if os.path.isdir(target) else shutil.copyfile)(target, dest)

    @rule(src=st.sampled_from(STORES), dst=st.sampled_from(STORES), earlier=st.booleans(), index=INDEX)
    def copy_across(self, src: str, dst: str, earlier: bool, index: int) -> None:
        """Copy a file or a directory from another store, or from an earlier (the untouched) copy of
        the same store, to the same place here: replays, splices, rollbacks."""
        if src == dst and not earlier:
            return  # a copy onto itself
        root = os.path.join(self.world.pristine, src) if earlier else self.world.path(src)
        files = _files(root)
        if not files:
            return
        rel = files[index % len(files)]
        source, dest = os.path.join(root, rel), os.path.join(self.world.path(dst), rel)
        if not os.path.lexists(source) or os.path.islink(source):
            return
        self.log.append(f"copy {'earlier ' if earlier else ''}{src}/{rel} -> {dst}")
        with contextlib.suppress(OSError, shutil.Error):  # a FIFO or a file where a directory was: no copy
            _remove(dest)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            (shutil.copytree if os.path.isdir(source) else shutil.copyfile)(source, dest)

    @rule(
        store=st.sampled_from(STORES),
        index=INDEX,
        key=st.booleans(),
        kind=st.sampled_from(["empty-dir", "fifo", "link", "sparse"]),
    )
    def replace_with(self, store: str, index: int, key: bool, kind: str) -> None:
        target = self._target(store, index, key)
        if not target:
            return
        self.log.append(f"{kind} at {target}")
        _remove(target)
        if not os.path.isdir(os.path.dirname(target)):
            return
        if kind == "empty-dir":
            os.makedirs(target)
        elif kind == "fifo":
            os.mkfifo(target)
        elif kind == "link":
            os.symlink(os.path.join(self.world.pristine, store), target)
        else:
            with open(target, "wb") as f:
                f.truncate(1 << 31)

    @rule(store=st.sampled_from(STORES), name=st.sampled_from(sorted(KEY_PATHS)))
    def delete_evidence(self, store: str, name: str) -> None:
        """Delete what evidence hangs on outright: the genesis, every chain, a kind of record."""
        self.log.append(f"delete {store}/{name}")
        _remove(os.path.join(self.world.path(store), name))

    @rule(store=st.sampled_from(STORES))
    def strip_to_an_unchained_store(self, store: str) -> None:
        """The attacker's shortcut to an "old" store: genesis, chains and incidents gone at once."""
        self.log.append(f"strip {store}")
        for name in ("genesis.json", "chains", "incidents", "sources"):
            _remove(os.path.join(self.world.path(store), "_ledger", name))

    @rule(store=st.sampled_from(RUNS))
    def delete_the_failures(self, store: str) -> None:
        """Every event segment that records a failed check, gone."""
        events = os.path.join(self.world.path(store), "_ledger", "events")
        self.log.append(f"delete failures of {store}")
        for name in sorted(os.listdir(events)) if os.path.isdir(events) else []:
            path = os.path.join(events, name)
            with contextlib.suppress(OSError):
                if os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) < 1 << 24:
                    with open(path, "rb") as f:
                        failed = b'"outcome":"fail"' in f.read()
                    if failed:
                        os.unlink(path)

    @rule(store=st.sampled_from(STORES), how=st.sampled_from(["truncate", "delete", "garble"]), index=INDEX)
    def break_a_chain_entry(self, store: str, how: str, index: int) -> None:
        chains = os.path.join(self.world.path(store), "_ledger", "chains")
        entries = [os.path.join(d, f) for d, _, fs in os.walk(chains) for f in fs]
        if not entries:
            return
        target = sorted(entries)[index % len(entries)]
        self.log.append(f"{how} chain entry {target}")
        with contextlib.suppress(OSError):
            if how == "delete":
                os.unlink(target)
            else:
                with open(target, "r+b") as f:
                    f.truncate(10) if how == "truncate" else f.write(b"{")

    @rule(store=st.sampled_from(STORES), claim=st.integers(1, 10**6))
    def unsigned_chain_entry(self, store: str, claim: int) -> None:
        chains = os.path.join(self.world.path(store), "_ledger", "chains")
        genesis = os.path.join(self.world.path(store), "_ledger", "genesis.json")
        if not os.path.isfile(genesis) or os.path.lexists(os.path.join(chains, "w" + "e" * 16)):
            return
        writers = sorted(os.listdir(chains)) if os.path.isdir(chains) else []
        self.log.append(f"unsigned entry in {store} seen {claim}")
        try:
            unsigned_entry(self.world.path(store), seen={w: claim for w in writers[:1] if w.startswith("w")})
        except (ValueError, KeyError, TypeError, OSError):
            pass  # a genesis the attacker already broke: nothing to link to

    @rule(store=st.sampled_from(STORES), kind=st.sampled_from(["revocations", "appeals", "clearances", "checkpoints"]))
    def unsigned_record(self, store: str, kind: str) -> None:
        """A record written by a certckpt writer without a key (its own unsigned chain seals it)."""
        from certckpt.trust.ledger import Ledger

        led = Ledger(self.world.path(store), signing_key=None, trusted_keys=None)
        self.log.append(f"unsigned {kind} in {store}")
        try:
            if kind == "revocations":
                led.write_record(
                    "revocations", "main@20-x.json", {"ckpt_id": "main@20", "reason": "x", "by": "m", "at": 1.0}
                )
            elif kind == "appeals":
                led.write_record(
                    "appeals",
                    "appeal-m.json",
                    {"appeal_id": "appeal-m", "device": "gpu-x", "convictions": [], "by": "m", "reason": "x"},
                )
            elif kind == "clearances":
                led.write_record(
                    "clearances",
                    "clear-m.json",
                    {"clearance_id": "clear-m", "device": "gpu-x", "approves": "appeal-m", "by": "e", "reason": "x"},
                )
            else:
                led.commit_checkpoint(branch="main", step=13, location=os.path.join(self.world.path(store), "x"))
        except (CertckptError, OSError):
            pass  # the store refuses the write (damaged, or the record exists): nothing written

    # --- the invariants ----------------------------------------------------------------------------

    @invariant()
    def no_level_is_higher_than_untouched(self) -> None:
        if not hasattr(self, "log"):
            return
        Attacker.moves += 1
        for store in (*RUNS, "vault"):
            try:
                now = levels(self.world.path(store))
            except CertckptError:
                continue  # a store that cannot be read certifies nothing
            was = self.untouched[store]
            for cid, level in now.items():
                assert RANK[level] <= RANK[was.get(cid, "suspect")], (
                    f"{store} {cid}: {level}, untouched {was.get(cid)}; moves: {self.log}"
                )


def _untouched(world: World) -> dict[str, dict[str, str]]:
    out = {s: levels(world.path(s)) for s in (*RUNS, "vault")}
    out["vault"] = {**out["clean"], **out["vault"]}  # a promote may bring any of the run's checkpoints
    return out


def test_a_keyless_attacker_never_raises_a_level_deletes_a_kept_copy_or_starts_a_convicted_device(
    kernel_world, rank0_group, tmp_path, monkeypatch
):
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", kernel_world.pub)
    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", kernel_world.writer)
    monkeypatch.setenv("CERTCKPT_STATE_DIR", str(tmp_path / "state"))
    kernel_world.restore()
    Attacker.world, Attacker.pg = kernel_world, rank0_group
    Attacker.untouched = _untouched(kernel_world)
    assert Attacker.untouched["prior"] == {"main@5": "suspect", "main@10": "suspect"}  # the conviction's work
    Attacker.releasable = {"main@5", "main@10"}
    run_state_machine_as_test(
        Attacker,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            derandomize=not LONG,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
        ),
    )
    print(f"attack model: {Attacker.runs} sequences, {Attacker.moves} moves, each followed by the invariants")
    # every operator command answered somewhere (an always-failing command would check nothing)
    assert {"status", "latest-good", "vault prune", "fleet ls"} <= Attacker.answered, Attacker.answered
