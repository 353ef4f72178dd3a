"""The trust kernel's world, shared by tests/trust/test_trust_kernel.py and tests/trust/test_attack_model.py: two
signed runs of 3 gloo ranks under one fleet registry (tests/support/kernel_cases.py), the clean run promoted
into a vault, built once per session and restored in place before each use (stores name each other by
absolute URL, so a copy elsewhere would still point at the originals)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from click.testing import CliRunner

from certckpt.errors import DeviceConvictedError
from certckpt.format.signing import generate_key
from certckpt.trust.chain import CHAINS_DIR, GENESIS, digest, entry_doc, entry_name
from certckpt.trust.fleet import Fleet
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store

STORES = ("clean", "prior", "det", "solo", "vault", "fleet")


@dataclass
class World:
    """Where the world lives (``live``), its untouched copy (``pristine``) and the keys."""

    live: str
    pristine: str
    writer: str  # private key of the training nodes and the promoter
    pub: str

    def path(self, name: str) -> str:
        return os.path.join(self.live, name)

    def restore(self) -> None:
        """Put the untouched world back where it lives (the stores' records name these paths)."""
        for name in STORES:
            live = self.path(name)
            if os.path.lexists(live):
                if os.path.isdir(live) and not os.path.islink(live):
                    shutil.rmtree(live, ignore_errors=True)
                else:
                    os.unlink(live)
            shutil.copytree(os.path.join(self.pristine, name), live, symlinks=True)


def build_world(root: str) -> World:
    """Train both runs on 3 gloo ranks, convict gpu-x, promote the clean run (~20 s on 2 cores)."""
    from certckpt.detect.launch import run_ranks
    from certckpt.trust.fleet import Fleet
    from certckpt.vault.promotion import promote
    from tests.support import kernel_cases

    keys = os.path.join(root, "keys")
    writer, pub = generate_key(os.path.join(keys, "writer"))
    live = os.path.join(root, "world")
    for name in STORES:
        os.makedirs(os.path.join(live, name))
    saved = {k: os.environ.get(k) for k in ("CERTCKPT_SIGNING_KEY", "CERTCKPT_TRUSTED_KEYS", "CERTCKPT_STATE_DIR")}
    os.environ.update(
        CERTCKPT_SIGNING_KEY=writer, CERTCKPT_TRUSTED_KEYS=pub, CERTCKPT_STATE_DIR=os.path.join(root, "state")
    )
    try:
        Fleet(os.path.join(live, "fleet")).create()
        args = {k: os.path.join(live, k) for k in STORES}
        out = run_ranks(kernel_cases.kernel_world, 3, args, timeout=300)
        assert [(o["caught"], o["solo"]) for o in out] == [(15, 15)] * 3, out
        promoted = promote(args["clean"], args["vault"])
        assert [p.ckpt_id for p in promoted] == ["main@5", "main@10", "main@15", "main@20"], promoted
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    pristine = os.path.join(root, "pristine")
    shutil.copytree(live, pristine, symlinks=True)
    return World(live=live, pristine=pristine, writer=writer, pub=pub)


def cli(*args: str):
    """Run one certckpt command in this process, as an operator would (the environment as it is)."""
    from certckpt_cli.main import main

    return CliRunner().invoke(main, list(args), catch_exceptions=True)


def start(w: World, pg, device: str, store: str) -> str | None:
    """A run's start check on ``device``; the refusal's text, None when it may start."""
    from certckpt.detect.fleet_check import check_fleet_at_start

    os.makedirs(store, exist_ok=True)
    try:
        check_fleet_at_start(
            Fleet(w.path("fleet")),
            policy="refuse",
            inventory={"0": {"device_id": device, "host": "node-y"}},
            rank=0,
            ledger=Ledger(store),
            run="new",
            branch="main",
            start_step=0,
            **pg,
        )
    except DeviceConvictedError as e:
        return str(e)
    return None


def levels(store: str) -> dict[str, str]:
    return {c: v.label for c, v in certify_store(store, write_certificates=False).certification.verdicts.items()}


def operator_reads(w: World) -> None:
    """What an operator does every day: every store read once, so this reader remembers them."""
    for name in ("clean", "prior", "det", "solo", "vault"):
        assert cli("status", w.path(name)).exit_code in (0, 1)
    assert cli("fleet", "ls", "--fleet", w.path("fleet")).exit_code == 0


def held(w: World) -> set[str]:
    return {n.removesuffix(".safetensors") for n in os.listdir(w.path("vault")) if n.endswith(".safetensors")}


def unsigned_entry(store: str, *, seen: dict[str, int]) -> None:
    """A chain entry a keyless writer adds: it links to the genesis, names the store, signs nothing."""
    ledger = os.path.join(store, "_ledger")
    with open(os.path.join(ledger, GENESIS), "rb") as f:
        genesis = f.read()
    doc = entry_doc(
        store=json.loads(genesis)["store_id"],
        writer="w" + "e" * 16,
        seq=1,
        prev=digest(genesis),
        scope="store",
        records=[],
        seen=seen,
        now=1.0,
    )
    os.makedirs(os.path.join(ledger, CHAINS_DIR, "w" + "e" * 16))
    with open(os.path.join(ledger, CHAINS_DIR, "w" + "e" * 16, entry_name(1)), "w") as f:
        json.dump(doc, f)


def a_real_writer(store: str) -> str:
    return sorted(os.listdir(os.path.join(store, "_ledger", CHAINS_DIR)))[0]
