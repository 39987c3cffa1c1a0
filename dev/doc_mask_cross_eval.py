"""Score two finished runs' final weights on the same validation windows, with and without the document mask,
so a --doc-mask on/off comparison separates what training learned from how it is scored.

    PYTHONPATH=. python dev/doc_mask_cross_eval.py RUN_A RUN_B [--batches 8]
"""

import argparse
import json
from pathlib import Path

from xtrain.autograd import no_grad
from xtrain.data.loader import TokenLoader
from xtrain.model import Model
from xtrain.train import checkpoint as ckpt_io
from xtrain.train.trainer import evaluate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--batches", type=int, default=8)
    args = ap.parse_args()
    print("| run | doc_mask in training | val loss, scored unmasked | val loss, scored masked |")
    print("|---|---|---:|---:|")
    for run in args.runs:
        ck = ckpt_io.read_checkpoint(run, with_optimizer=False)
        model = Model(ck.model_config)
        ckpt_io.restore(ck, model)
        tc = ck.train_config
        meta = json.loads((Path(tc.extra["data_dir"]) / "meta.json").read_text())
        root = Path(meta["dir"]) if "dir" in meta else Path(tc.extra["data_dir"])
        val = TokenLoader([root / f for f, _ in meta["val"]["files"]], tc.batch_size, tc.seq_len, seed=tc.seed,
                          vocab_size=meta["vocab_size"])  # fmt: skip
        with no_grad():
            plain = evaluate(model, val.val_batches(args.batches))["eval_loss"]
            masked = evaluate(model, val.val_batches(args.batches), doc_eot=meta["eot_id"])["eval_loss"]
        print(f"| {run} | {tc.doc_mask} | {plain:.4f} | {masked:.4f} |")


if __name__ == "__main__":
    main()
