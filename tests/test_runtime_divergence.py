"""Ranks that would communicate differently raise the same error on every rank, naming the
units and parameters, instead of hanging or aborting inside a mismatched collective; a rank
left waiting by a stuck peer ends on SIGINT and SIGTERM."""
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch

import lightning_matrixfsdp as mf
from conftest import clean_env
from helpers.models import TinyLM, batch_for, lm_loss

TESTS = os.path.dirname(os.path.abspath(__file__))


def _divergence_worker(rank: int, world: int, case: str, env: dict) -> str:
    os.environ.update(env)
    torch.manual_seed(0)
    model = TinyLM(experts=2 if case == "expert_on_some_ranks" else 0, extra_branch=case == "flush_flags_differ")
    if case == "flush_flags_differ":
        # a frozen root parameter keeps the root's reduction for the end-of-backward flush on every rank
        model.pos.requires_grad_(False)
    mf.matrix_shard(model)
    if case == "expert_on_some_ranks":
        for blk in model.blocks:  # rank 0 runs both experts, rank 1 only the first
            blk.route = None if rank == 0 else 0
    if case == "flush_flags_differ" and rank == 1:
        model.use_branch = False
    if case == "unit_skipped" and rank == 1:
        def skip_first_block(self, idx):
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            return self.head(self.ln_f(self.blocks[1](x)))

        model.forward = types.MethodType(skip_first_block, model)
    try:
        for step in range(2):
            if case == "unit_called_directly" and rank == 1:
                with torch.no_grad():
                    model.blocks[0](torch.zeros(2, 16, 32))
            if case == "submodule_called_directly" and rank == 1:
                with torch.no_grad():
                    model.blocks[0].fc(torch.zeros(2, 32))
            batch = batch_for(step, rank)
            lm_loss(model(batch), batch).backward()
    except mf.RankDivergenceError as e:
        return str(e)
    return "no error"


def _same_error_everywhere(dist_pools, case: str, env: dict | None = None) -> str:
    msgs = dist_pools(2).run(_divergence_worker, case, env or {}, timeout=120)
    assert msgs[0] == msgs[1] != "no error", msgs
    return msgs[0]


def test_unit_skipped_on_one_rank_names_both_units(dist_pools):
    msg = _same_error_everywhere(dist_pools, "unit_skipped")
    assert "rank 0 is about to materialize unit 'blocks.0'" in msg, msg
    assert "rank 1 is about to materialize unit 'blocks.1'" in msg, msg


def test_unit_called_directly_on_one_rank_names_it(dist_pools):
    msg = _same_error_everywhere(dist_pools, "unit_called_directly")
    assert "rank 0 is about to materialize unit '<root>'" in msg, msg
    assert "rank 1 is about to materialize unit 'blocks.0'" in msg, msg


def test_submodule_called_on_one_rank_names_both_units(dist_pools):
    """A unit's submodule called by itself runs as a call of its unit (test_outside_calls.py): on
    one rank only, every rank names what each was about to materialize."""
    msg = _same_error_everywhere(dist_pools, "submodule_called_directly")
    assert "rank 0 is about to materialize unit '<root>'" in msg, msg
    assert "rank 1 is about to materialize unit 'blocks.0'" in msg, msg


def test_expert_used_on_some_ranks_names_its_parameters_and_the_option(dist_pools):
    msg = _same_error_everywhere(dist_pools, "expert_on_some_ranks")
    assert "blocks.1.experts.1.weight" in msg and "zero_missing_grads=True" in msg, msg


@pytest.mark.parametrize("sequence_check", ["auto", "0"])
def test_used_flags_that_differ_in_the_flush_raise(sequence_check, dist_pools):
    env = {} if sequence_check == "auto" else {"MATRIX_FSDP_CHECK_SEQUENCE": sequence_check}
    msg = _same_error_everywhere(dist_pools, "flush_flags_differ", env)
    assert "unit '<root>' got a gradient on some ranks but not on others: branch.weight, branch.bias" in msg, msg
    assert "zero_missing_grads=True" in msg, msg


# ---------------------------------------------------------------------- signals
RUNTIME_SCRIPT = """
    import os, signal, sys, time
    import torch.distributed as dist
    import lightning_matrixfsdp as mf
    from helpers.models import TinyLM, batch_for

    # One interpreter start-up for both signals: after the imports, before anything distributed,
    # this launcher forks the two ranks of each case's own world (argv: one port per case) and
    # reports how each ended. Each rank writes to its own log file.
    children = {}
    me = None
    for case, port in enumerate(sys.argv[1:]):
        for r in (0, 1):
            pid = os.fork()
            if pid == 0:
                me = (case, r, port)
                break
            children[pid] = (case, r)
        if me is not None:
            break
    if me is None:  # the launcher
        while children:
            pid, status = os.wait()
            case, r = children.pop(pid)
            print(f"case {case} rank {r} exit {os.waitstatus_to_exitcode(status)}", flush=True)
        sys.exit(0)
    case, rank, port = me
    log = os.open(f"case{case}_rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(MASTER_PORT=port, RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # as Lightning does: a Python SIGTERM handler that only takes note
    signal.signal(signal.SIGTERM, lambda signum, frame: print("noted SIGTERM", flush=True))
    model = mf.matrix_shard(TinyLM())
    print(f"rank {rank} pid {os.getpid()} waits", flush=True)
    if rank == 1:
        time.sleep(600)  # a stuck peer
    model(batch_for(0, rank))
"""

LIGHTNING_SCRIPT = """
    import os, sys, time
    import torch
    from lightning.pytorch import LightningModule, Trainer
    import lightning_matrixfsdp as mf
    from helpers.models import TinyLM, batch_for, lm_loss


    class Lit(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = TinyLM()

        def training_step(self, batch, i):
            print(f"rank {self.global_rank} pid {os.getpid()} waits", flush=True)
            if self.global_rank == 1:
                time.sleep(600)  # a stuck peer
            return lm_loss(self.model(batch), batch)

        def configure_optimizers(self):
            return mf.Muon(self.parameters(), lr=0.02)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.stack([batch_for(i, 0)[0] for i in range(8)]), batch_size=2)


    def fit():
        Trainer(accelerator="cpu", devices=2, strategy="matrix_fsdp", max_steps=2, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(Lit())


    if __name__ == "__main__":
        if "LOCAL_RANK" in os.environ:  # rank 1, started by Lightning's launcher in its rank 0
            fit()
            sys.exit(0)
        # One interpreter start-up for both signals' rank 0: after the imports, this launcher forks
        # one rank 0 per case (argv: one port per case; each case's ranks write to its own log file)
        # and reports how each ended.
        children = {}
        for case, port in enumerate(sys.argv[1:]):
            pid = os.fork()
            if pid == 0:
                log = os.open(f"case{case}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ["MASTER_PORT"] = port
                fit()
                sys.exit(0)
            children[pid] = case
        while children:
            pid, status = os.wait()
            print(f"case {children.pop(pid)} rank 0 exit {os.waitstatus_to_exitcode(status)}", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


SIGNALS = ("SIGINT", "SIGTERM")


@pytest.fixture(scope="module")
def runtime_signals(tmp_path_factory) -> dict:
    """``_signals_launch`` of RUNTIME_SCRIPT once for this file's runtime signal tests."""
    return _signals_launch(str(tmp_path_factory.mktemp("signals")), "runtime")


@pytest.fixture(scope="module")
def lightning_signals(tmp_path_factory) -> dict:
    """``_signals_launch`` of LIGHTNING_SCRIPT once for this file's Lightning signal tests."""
    return _signals_launch(str(tmp_path_factory.mktemp("signals")), "lightning")


def _signals_launch(tmp: str, launch: str) -> dict:
    """Both signals in one run of RUNTIME_SCRIPT or LIGHTNING_SCRIPT (one world of 2 per signal):
    per signal, rank 0's exit status, the seconds from the signal to its exit, its output (under
    Lightning: both ranks'), and whether the stuck rank 1 was still alive up to 10 s after that."""
    script = os.path.join(tmp, "run.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(RUNTIME_SCRIPT if launch == "runtime" else LIGHTNING_SCRIPT))
    env = clean_env(PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    if launch == "runtime":  # both ranks forked by the launcher; under Lightning, rank 1 started by rank 0
        env.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE="2")
    launcher = subprocess.Popen([sys.executable, script] + [str(_free_port()) for _ in SIGNALS], env=env, cwd=tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True).start()

    def log(case: int, rank: int) -> str:
        name = f"case{case}_rank{rank}.log" if launch == "runtime" else f"case{case}.log"  # both ranks' under Lightning
        try:
            with open(os.path.join(tmp, name)) as f:
                return f.read()
        except OSError:
            return ""

    pids: dict = {}
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 * len(SIGNALS):
            for case in range(len(SIGNALS)):
                for rank in (0, 1):
                    found = re.search(rf"rank {rank} pid (\d+) waits", log(case, rank))
                    if found:
                        pids[case, rank] = int(found.group(1))
            assert time.monotonic() < deadline and launcher.poll() is None, (
                "".join(lines)[-2000:], [log(c, r)[-2000:] for c in range(len(SIGNALS)) for r in (0, 1)])
            time.sleep(0.1)
        time.sleep(2)  # each rank 0 is now waiting for its rank 1 in the runtime's first collective
        start = time.monotonic()
        for case, sig in enumerate(SIGNALS):
            os.kill(pids[case, 0], getattr(signal, sig))
        out, ended = {}, {}
        while len(ended) < len(SIGNALS) and time.monotonic() < start + 20:
            for case in range(len(SIGNALS)):
                if case not in ended and f"case {case} rank 0 exit" in "".join(lines):
                    ended[case] = time.monotonic() - start
            time.sleep(0.02)
        time.sleep(0.5)
        text = "".join(lines)
        end = time.monotonic() + 10  # Lightning's shutdown also ends the stuck rank it started
        while (launch == "lightning" and any(_alive(pids[case, 1]) for case in range(len(SIGNALS)))
               and time.monotonic() < end):
            time.sleep(0.1)
        for case, sig in enumerate(SIGNALS):
            rc = re.search(rf"case {case} rank 0 exit (-?\d+)", text)
            out[sig] = (int(rc.group(1)) if rc else None, ended.get(case, float("inf")), log(case, 0),
                        _alive(pids[case, 1]))
        return out
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            launcher.wait(timeout=20)
        finally:
            if launcher.poll() is None:
                launcher.kill()


@pytest.mark.parametrize("sig", SIGNALS)
def test_runtime_rank_waiting_for_a_stuck_peer_ends_on_signal(runtime_signals, sig):
    """Ranks started by hand (forks of one launcher, after its imports); rank 0 waits for a stuck
    rank 1 in the runtime's first collective and gets the signal."""
    rc, took, out, _ = runtime_signals[sig]
    assert rc is not None and rc != 0 and took < 10, (rc, took, out[-3000:])
    assert "CollectiveInterrupted" in out or "Detected KeyboardInterrupt" in out, out[-3000:]


@pytest.mark.parametrize("sig", SIGNALS)
def test_lightning_rank_waiting_for_a_stuck_peer_ends_on_signal(lightning_signals, sig):
    """Lightning's launcher starts rank 1 from rank 0 (each rank 0 a fork of one launcher, after its
    imports; rank 1 a fresh interpreter); rank 0 gets the signal, and Lightning's shutdown also
    ends the stuck rank it started."""
    rc, took, out, stuck_alive = lightning_signals[sig]
    assert rc is not None and rc != 0 and took < 10, (rc, took, out[-3000:])
    assert "CollectiveInterrupted" in out or "Detected KeyboardInterrupt" in out, out[-3000:]
    assert not stuck_alive, out[-3000:]
