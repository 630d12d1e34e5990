"""The model: maths only. Parallelism enters through logical dim names (`jaxpar.sharding`)."""

from jaxpar.model.blocks import register_block
from jaxpar.model.transformer import (Params, Transformer, apply, bind, count_params, dense_config, init_params,
                                      param_names, param_shapes)

__all__ = ["Params", "Transformer", "apply", "bind", "count_params", "dense_config", "init_params", "param_names", "param_shapes",
           "register_block"]
