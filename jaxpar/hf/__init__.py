"""Hugging Face model folders (config.json + *.safetensors) in and out, for `llama` (and its
families mistral, qwen2, qwen3), `gpt2`, the mixture-of-experts families mixtral and qwen3_moe,
and DeepSeek-V3's `deepseek_v3` (Kimi K2's `kimi_k2` read the same way).

The modules, each importing only those before it:

  common.py   HFError, `refuse` (a refused config.json setting), `Entry`, publishing a folder
  moe.py      the Mixtral / Qwen3-MoE families: their config.json keys and expert tensors
  deepseek.py the DeepSeek-V3 family: its config.json keys, tensors and interleaved rotary rows
  config.py   config.json <-> ModelConfig: `config_from_hf`, `hf_config`, `check_matches`
  tensors.py  weights in and out: `entries` (the name maps), `load_params`, `save_params`

Every name is re-exported here: `jaxpar.hf.config_from_hf`, `jaxpar.hf.load_params`, ...
"""

from jaxpar.hf.common import TOKENIZER_FILES, Entry, HFError, publish, refuse, tokenizer_files
from jaxpar.hf.config import (LLAMA_FAMILIES, LLAMA_SEQ_CAP, check_matches, config_from_hf, hf_config,
                              read_hf_config, trained_length)
from jaxpar.hf.tensors import (INDEX, MAX_SHARD_BYTES, SINGLE, Getter, _gpt2_prefix, _leaf, _normalize, entries,
                               from_tensors, load_params, read_leaf, save_params, to_tensors)

__all__ = ["INDEX", "LLAMA_FAMILIES", "LLAMA_SEQ_CAP", "MAX_SHARD_BYTES", "SINGLE", "TOKENIZER_FILES", "Entry",
           "Getter", "HFError", "check_matches", "config_from_hf", "entries", "from_tensors", "hf_config",
           "load_params", "publish", "read_hf_config", "read_leaf", "refuse", "save_params", "to_tensors",
           "tokenizer_files", "trained_length"]
