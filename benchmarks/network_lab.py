"""Side-by-side benchmarks on the network lab: step time and time to accuracy.

Runs, as `hexagram bench` / `hexagram train` commands (printed before each run):
  1. step time of every algorithm (PyTorch DDP options + every registered Hexagram
     algorithm) for 4 hosts at 100 Mbit/s, 1 Gbit/s and unshaped, MLP of ~10M parameters;
  2. unshaped, `ddp` against `allreduce` in 3 alternating rounds (noise of a shared machine);
  3. 2 hosts x 2 ranks at 100 Mbit/s: flat against hierarchical allreduce;
  4. time to accuracy on Fashion-MNIST at 100 Mbit/s for DDP and a few Hexagram algorithms;
  5. step time of a small GPT (many small tensors) at 100 Mbit/s;
  6. time to a validation loss of the character-level GPT on the offline text corpus;
  7. the efficiency studies at 100 Mbit/s: 256 samples per rank, and the same parameter
     budget in 8 hidden layers (gradients ready evenly).
Outputs go to --out (JSON, PNG, Markdown tables). Needs root (network namespaces).

    .venv/bin/python benchmarks/network_lab.py --out /tmp/netlab \
        [--only step|main|train|gpt|text|efficiency]
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from hexagram.cli import main as hexagram_main

#: Hexagram algorithms for the time-to-accuracy run, in order, when registered.
TRAIN_ALGORITHMS = ("powersgd", "gtopk", "efsign", "local_sgd", "qsgd")


def _run(argv: list[str]) -> int:
    print(f"\n$ hexagram {shlex.join(argv)}", flush=True)
    t0 = time.monotonic()
    code = hexagram_main(argv)
    print(f"(exit {code}, {time.monotonic() - t0:.0f} s)", flush=True)
    return code


#: Periods short enough that the timed window holds whole rounds; compression from step 0.
SETTINGS = ["--set", "powersgd.start_iter=0", "--set", "diloco.period=8",
            "--set", "local_sgd.period=8"]


def step_time(out: Path, params: int, steps: int, algorithms: str,
              main_only: bool = False) -> None:
    common = ["--model", "mlp", "--params", str(params), "--batch", "32", "--warmup", "2",
              "--stall-timeout", "45", "--quiet", *SETTINGS]
    _run(["bench", "--hosts", "4", "--bandwidth", "100mbit,1gbit,unshaped",
          "--algorithms", algorithms, "--steps", str(steps), "--time-limit", "30",
          "--json", str(out / "step.json"), "--plot", str(out / "step.png"),
          "--markdown", str(out / "step.md"), *common])
    if main_only:
        return
    _run(["bench", "--hosts", "4", "--bandwidth", "unshaped", "--algorithms", "ddp,allreduce",
          "--rounds", "3", "--steps", "10", "--json", str(out / "parity.json"),
          "--markdown", str(out / "parity.md"), *common])
    _run(["bench", "--hosts", "2", "--ranks-per-host", "2", "--bandwidth", "100mbit",
          "--algorithms", "ddp,allreduce,allreduce:hierarchical=true", "--steps", "5",
          "--json", str(out / "hierarchy.json"), "--markdown", str(out / "hierarchy.md"),
          *common])


def time_to_accuracy(out: Path, target: float, epochs: int, algorithms: str) -> None:
    _run(["train", "--hosts", "4", "--bandwidth", "100mbit", "--dataset", "fashion-mnist",
          "--model", "mlp", "--params", "1000000", "--layers", "2", "--batch", "32",
          "--lr", "0.05", "--algorithms", algorithms, "--target", str(target),
          "--epochs", str(epochs), "--evals-per-epoch", "8", "--time-limit", "900",
          "--json", str(out / "tta.json"), "--plot", str(out / "tta.png"),
          "--markdown", str(out / "tta.md")])


#: GPT of 3.2M parameters in 4 blocks: 52 tensors, most of them small.
GPT = ["--layers", "4", "--width", "256", "--seq", "64"]
GPT_ALGORITHMS = "ddp,ddp-fp16,allreduce,fp16,powersgd,qsgd,bytegrad,topk,dgc,local_sgd"


def gpt_step_time(out: Path) -> None:
    _run(["bench", "--hosts", "4", "--bandwidth", "100mbit", "--model", "gpt", *GPT,
          "--batch", "8", "--algorithms", GPT_ALGORITHMS, "--warmup", "2", "--steps", "4",
          "--time-limit", "40", "--quiet", "--set", "powersgd.start_iter=0",
          "--set", "local_sgd.period=4", "--json", str(out / "gpt.json"),
          "--markdown", str(out / "gpt.md")])


def text_time_to_loss(out: Path) -> None:
    _run(["train", "--hosts", "4", "--bandwidth", "100mbit", "--dataset", "text", *GPT,
          "--batch", "16", "--algorithms", "ddp,fp16,powersgd,qsgd,local_sgd,diloco",
          "--target", "2.65", "--epochs", "2", "--evals-per-epoch", "8",
          "--time-limit", "420", "--json", str(out / "text.json"),
          "--plot", str(out / "text.png"), "--markdown", str(out / "text.md")])


#: The compressed algorithms the 8-layer study compares with DDP.
EVEN_ALGORITHMS = "ddp,powersgd,topk,signsgd,onebit,efsign,terngrad,qsgd,bytegrad,dgc,gtopk,randomk"


def efficiency_studies(out: Path, params: int) -> None:
    """More compute per step (batch 256), and gradients ready evenly (8 layers)."""
    _run(["bench", "--hosts", "4", "--bandwidth", "100mbit", "--algorithms", "all",
          "--model", "mlp", "--params", str(params), "--batch", "256", "--warmup", "2",
          "--steps", "4", "--time-limit", "30", "--stall-timeout", "60", "--quiet",
          "--set", "powersgd.start_iter=0", "--set", "diloco.period=4",
          "--set", "local_sgd.period=4", "--json", str(out / "b256.json"),
          "--markdown", str(out / "b256.md")])
    _run(["bench", "--hosts", "4", "--bandwidth", "100mbit", "--model", "mlp",
          "--params", str(params), "--layers", "8", "--batch", "32", "--warmup", "2",
          "--steps", "6", "--time-limit", "30", "--stall-timeout", "45", "--quiet",
          "--algorithms", EVEN_ALGORITHMS, "--set", "powersgd.start_iter=0",
          "--json", str(out / "layers8.json"), "--markdown", str(out / "layers8.md")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/hexagram-netlab")
    parser.add_argument("--only", choices=("step", "train", "main", "gpt", "text",
                                           "efficiency"),
                        help="step: the three step-time runs; main: only the first one; "
                             "gpt, text, efficiency: runs 5, 6 and 7")
    parser.add_argument("--params", type=int, default=10_500_000)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--algorithms", default="all", help="for the step-time run")
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--train-algorithms", default=None,
                        help="default: ddp, ddp-fp16 and the registered TRAIN_ALGORITHMS")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "gpt"):
        gpt_step_time(out)
    if args.only in (None, "text"):
        text_time_to_loss(out)
    if args.only in (None, "efficiency"):
        efficiency_studies(out, args.params)
    if args.only in ("gpt", "text", "efficiency"):
        return
    if args.only != "train":
        step_time(out, args.params, args.steps, args.algorithms, main_only=args.only == "main")
    if args.only is None or args.only == "train":
        from hexagram.algorithms import names

        train_algos = args.train_algorithms or ",".join(
            ["ddp", "ddp-fp16", *[n for n in TRAIN_ALGORITHMS if n in names()]])
        time_to_accuracy(out, args.target, args.epochs, train_algos)


if __name__ == "__main__":
    main()
