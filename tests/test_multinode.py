"""Two "nodes" on localhost: two `accelerate launch` commands with examples/accelerate_configs/multi_node_ddp.yaml,
--machine_rank 0 and 1, one process each, rendezvous at 127.0.0.1 (CPU, gloo), each running the product's
`causal-adapter train` (python -m causal_adapter train) on the embedded tiny base. docs/multinode.md."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

from causal_adapter import CausalModel, get_causal_model
from causal_adapter.saving.assets import load_base

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "accelerate_configs" / "multi_node_ddp.yaml"
NODE_TIMEOUT_S = 120  # a node whose peer never comes hangs in the rendezvous: killed, and the test fails
TRAIN = ["-m", "causal_adapter", "train", "--max-steps", "3", "--eval-steps", "3", "--save-steps", "3",
         "--max-train-samples", "24", "--max-eval-samples", "8", "--per-device-train-batch-size", "2",
         "--plot", "false", "--progress", "false", "--expected-num-processes", "2", "--seed", "3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(tmp_path: Path, ranks=(0, 1), outs: dict | None = None, extra=()):
    """One `accelerate launch` per node rank, started together -> (processes, node 0's output dir). outs: a node
    rank's own output dir (default: one shared dir); extra: more `train` flags."""
    port, out = free_port(), tmp_path / "out"
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "HF_HUB_OFFLINE": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    procs = []
    for k in ranks:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
               "--num_processes", "2", "--machine_rank", str(k), "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), "--mixed_precision", "no", *TRAIN, *extra,
               "--output-dir", str((outs or {}).get(k, out))]
        with open(tmp_path / f"node{k}.log", "w") as log:
            procs.append((k, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path),
                                              start_new_session=True)))
    return procs, out


def wait_nodes(tmp_path: Path, procs, deadline: float):
    """(return codes, logs) of `start_nodes`' processes; a node still running at `deadline` (time.monotonic()) is
    killed (return code None)."""
    codes = []
    for k, p in procs:
        try:
            codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)  # the launcher and the worker it started
            p.wait()
            codes.append(None)
    return codes, [(tmp_path / f"node{k}.log").read_text() for k, _ in procs]


def launch_nodes(tmp_path: Path, ranks=(0, 1), timeout=NODE_TIMEOUT_S, outs: dict | None = None, extra=()):
    """`start_nodes`, then `wait_nodes` at most `timeout` s -> (return codes, logs, node 0's output dir)."""
    procs, out = start_nodes(tmp_path, ranks, outs, extra)
    return (*wait_nodes(tmp_path, procs, time.monotonic() + timeout), out)


@pytest.fixture(scope="module")
def lone_node(tmp_path_factory):
    """Node 0 of 2 started alone, before the module's other launches (`two_nodes` asks for it first), so that
    its wait overlaps them: (processes, output dir, tmp dir, when it started)."""
    tmp = tmp_path_factory.mktemp("lone_node")
    procs, out = start_nodes(tmp, ranks=(0,))
    yield procs, out, tmp, time.monotonic()
    for _, p in procs:  # the test did not run (deselected): no node left behind
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, lone_node):
    """One run of 2 nodes x 1 process: (return codes, logs, node 0's output dir). The tests read it; one that
    launches more nodes on it copies the output dir first. (`lone_node` only starts first.)"""
    return launch_nodes(tmp_path_factory.mktemp("two_nodes"))


def test_two_nodes_one_process_each_train_save_once_and_reload(two_nodes):
    codes, logs, out = two_nodes
    assert codes == [0, 0], "\n\n".join(log[-4000:] for log in logs)
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["num_processes"] == 2 and final["global_step"] == 3
    assert "LaunchWarning" not in logs[0] + logs[1]
    # both ranks took part: rank 1's RNG state reached rank 0's checkpoint (gathered), the evaluation
    # covers the 8 validation rows once (4 per rank, gathered), the checkpoint records 2 processes
    ck = out / "checkpoint-3"
    assert {"rng_state_0.json", "rng_state_1.json"} <= {f.name for f in ck.iterdir()}
    assert json.loads((ck / "trainer_state.json").read_text())["num_processes"] == 2
    assert final["eval"]["baseline_examples"] == 8
    # saved once, by the main process (node 0): its summary names the adapter, node 1's does not
    assert sum(f"adapter: {out / 'adapter'}" in log for log in logs) == 1 and "adapter:" in logs[0]
    assert sorted(f.name for f in (out / "adapter").iterdir()) == [
        "README.md", "causal_adapter_config.json", "causal_adapter_model.safetensors"]
    model = CausalModel.from_pretrained(load_base()[0], str(out / "adapter"))
    trained = model.adapter_state_dict()
    saved = load_file(str(out / "adapter" / "causal_adapter_model.safetensors"))
    assert set(saved) <= set(trained)
    assert all(torch.equal(trained[k].reshape(v.shape), v) for k, v in saved.items())
    init = get_causal_model(load_base()[0], model.causal_config).adapter_state_dict()
    assert set(init) == set(trained)
    assert not torch.equal(trained["action.b_cls"], init["action.b_cls"])  # it trained

@pytest.mark.slow
def test_resume_where_a_node_lacks_the_checkpoint_is_refused_on_every_node_not_a_hang(tmp_path, two_nodes):
    """Node 1 resumes in an output dir without the checkpoint node 0 has (an unshared filesystem): before, node 0
    resumed at step 3, node 1 started at 0, and both hung in their collectives. Now both stop with the reason.
    Node 0 resumes in a copy of the module's finished 2-node run (the same launch this test made before)."""
    codes, logs, first = two_nodes
    assert codes == [0, 0] and (first / "checkpoint-3").is_dir(), "\n\n".join(log[-3000:] for log in logs)
    shutil.copytree(first, tmp_path / "out")  # launch_nodes' default output dir: node 0's
    empty = tmp_path / "node1_out"
    codes, logs, _ = launch_nodes(tmp_path, outs={1: empty}, extra=("--max-steps", "6", "--resume-from-checkpoint",
                                                                    "latest"))
    assert None not in codes and codes != [0, 0], "a node hung"
    for log in logs:
        assert "would resume from different checkpoints (rank 0: checkpoint-3, rank 1: no checkpoint)" in log, log[-3000:]


@pytest.mark.slow
def test_a_missing_node_fails(lone_node):
    """Node 0 alone: the rendezvous never completes, the run does not finish (killed 25 s after its start; the
    2-node runs take about 14 s here, 3 steps included)."""
    procs, out, tmp, started = lone_node
    codes, logs = wait_nodes(tmp, procs, started + 25)
    assert codes != [0], logs
    assert not (out / "final_metrics.json").exists()


@pytest.mark.parametrize("name", ["multi_node_ddp", "multi_node_fsdp2", "multi_node_deepspeed_zero3"])
def test_multi_node_templates_give_each_node_its_rank_and_the_rendezvous(name):
    """accelerate's own parsing of each template, as `accelerate launch` on node 1 of 2 does it: the
    torchrun arguments (nnodes, node_rank, processes per node, rendezvous endpoint) and the engine's settings."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from causal_adapter.saving.fsdp import FSDP_IGNORED_MODULES

    args = launch_command_parser().parse_args([
        "--config_file", str(CONFIG.parent / f"{name}.yaml"), "--machine_rank", "1", "--main_process_ip",
        "192.168.0.7", "--main_process_port", "29555", "-m", "causal_adapter", "train"])
    args, _, _ = _validate_launch_command(args)
    assert (args.num_machines, args.num_processes, args.rdzv_backend) == (2, 16, "static")
    if name.endswith("zero3"):
        assert args.use_deepspeed and args.zero_stage == 3
        assert args.deepspeed_multinode_launcher == "standard"  # torchrun on every node, like DDP / FSDP
    env = prepare_multi_gpu_env(args)  # what the DDP / FSDP launcher and DeepSpeed's "standard" one pass to torchrun
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "8")
    # accelerate 1.15 never copies `same_network: true` from a file (its flag defaults to False, not None):
    # the node reaches node 0 through --rdzv_endpoint, which the static rendezvous treats as the master address
    assert args.rdzv_endpoint == "192.168.0.7:29555"
    if name.endswith("fsdp2"):
        assert env["FSDP_VERSION"] == "2" and env["FSDP_IGNORED_MODULES"] == FSDP_IGNORED_MODULES
        assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
