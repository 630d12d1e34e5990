"""Run configuration: frozen, typed dataclasses, YAML presets, dotted overrides, validation.

Everything a user can get wrong in a config is caught before JAX compiles anything, and reported as
one sentence that names the value, the rule and a fix (`ConfigError`): here, every rule that needs
only the config; in `jaxpar.parallel.checks`, those of the mesh's sizes that need the pipeline's
schedule tables and stage layouts.

The foundation: this package imports nothing of jaxpar but `jaxpar.errors`.

  schema.py    the dataclasses (a docstring under every field) and `from_dict`
  load.py      YAML files, `--set` overrides, `load_config`, `to_yaml`
  rules.py     `validate`, the syntax of runtime.xla_flags, `resolve_mesh_shape`
"""

from jaxpar.config.schema import (Config, DataConfig, MeshConfig, ModelConfig, ParallelConfig, RuntimeConfig,
                                  TrainConfig, from_dict, parse_moe_layers)
from jaxpar.config.rules import resolve_mesh_shape, validate
from jaxpar.config.load import load_config, parse_override, to_yaml
from jaxpar.errors import ConfigError, JaxparError

__all__ = ["Config", "ConfigError", "DataConfig", "JaxparError", "MeshConfig", "ModelConfig", "ParallelConfig",
           "RuntimeConfig", "TrainConfig", "from_dict", "load_config", "parse_moe_layers", "parse_override",
           "resolve_mesh_shape", "to_yaml", "validate"]
