"""Evaluation in the loop: validation loss and perplexity, the same on every mesh."""

from __future__ import annotations

import math

import numpy as np

import jaxpar


def test_validation_loss_is_logged_and_the_same_on_every_mesh(tiny, tmp_path):
    runs = {}
    for mesh, parallel in [((8, 1, 1), {}), ((2, 2, 2), {"microbatches": 2, "zero": 1})]:
        cfg = tiny(mesh=dict(zip(("data", "stage", "model"), mesh)), parallel=parallel,
                   train={"steps": 4, "eval_every": 2, "eval_batches": 2, "log_every": 1,
                          "run_dir": str(tmp_path / "x".join(map(str, mesh)))})
        runs[mesh] = {r["step"]: r for r in jaxpar.train(cfg)}
    for records in runs.values():
        assert [s for s, r in records.items() if "val_loss" in r] == [2, 4]
        for s in (2, 4):
            assert records[s]["val_ppl"] == math.exp(records[s]["val_loss"])
        assert records[4]["val_loss"] < records[2]["val_loss"]  # the model learns the chain
    a, b = runs[(8, 1, 1)], runs[(2, 2, 2)]
    # The same batches and parameters; the two layouts differ only in the order of float32 sums
    # (the parity tests' ~1e-6 per step), so after 4 steps the validation losses agree to 1e-5.
    np.testing.assert_allclose([a[s]["val_loss"] for s in (2, 4)], [b[s]["val_loss"] for s in (2, 4)],
                               rtol=0, atol=1e-5)
