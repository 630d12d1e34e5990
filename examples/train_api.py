"""Train from research code through the Python API: load a preset, override keys, read the metrics.

    python examples/train_api.py
"""

import jaxpar

cfg = jaxpar.load_config("configs/tiny_gpt2.yaml", ["train.steps=60", "train.log_every=20",
                                                    "train.run_dir=runs/api_example"])
for record in jaxpar.train(cfg):
    print(f"step {record['step']:>4}  loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s")
