"""tzrec-ops: HSTU generative-recommender kernels with pluggable backends.

Every public op takes ``backend=`` (a name or a :class:`~tzrec_ops.registry.Backend`);
see :mod:`tzrec_ops.registry` for how a backend is chosen when it is omitted, and
``tzrec_ops.registry.backends()`` for the registered backends (``tzrec_ops.backends`` is the
package holding the built-in ones).
"""

from tzrec_ops.hookspecs import hookimpl
from tzrec_ops.ops.host_copies import remember_host_copy, to_device
from tzrec_ops.ops.hstu_attention import delta_hstu_mha, hstu_mha
from tzrec_ops.ops.hstu_attention_utils import build_sla_func_tensor
from tzrec_ops.ops.hstu_compute import (
    hstu_compute_output,
    hstu_compute_uqvk,
    hstu_preprocess_and_attention,
)
from tzrec_ops.ops.jagged_2d import (
    concat_2D_jagged,
    jagged_dense_bmm_broadcast_add,
    split_2D_jagged,
)
from tzrec_ops.ops.layer_norm import (
    group_norm_mul_dropout,
    layer_norm,
    layer_norm_mul_dropout,
    rms_norm,
    swish_layer_norm,
)
from tzrec_ops.ops.mm import addmm
from tzrec_ops.ops.position import add_positional_embeddings, add_timestamp_positional_embeddings
from tzrec_ops.ops.truncation import (
    STUTruncationPlan,
    apply_stu_truncation_plan,
    compute_stu_truncation_plan,
)
from tzrec_ops.ops.utils import (
    autotune_max_seq_len,
    prev_power_of_2,
    set_static_max_seq_lens,
    set_use_runtime_max_seq_len,
    switch_to_contiguous_if_needed,
)
from tzrec_ops.ops.validation import set_value_checks
from tzrec_ops.registry import (
    Backend,
    BackendError,
    get_backend,
    resolve_backend,
    select_backend,
)

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendError",
    "STUTruncationPlan",
    "add_positional_embeddings",
    "add_timestamp_positional_embeddings",
    "addmm",
    "apply_stu_truncation_plan",
    "autotune_max_seq_len",
    "build_sla_func_tensor",
    "compute_stu_truncation_plan",
    "concat_2D_jagged",
    "delta_hstu_mha",
    "get_backend",
    "group_norm_mul_dropout",
    "hookimpl",
    "hstu_compute_output",
    "hstu_compute_uqvk",
    "hstu_mha",
    "hstu_preprocess_and_attention",
    "jagged_dense_bmm_broadcast_add",
    "layer_norm",
    "layer_norm_mul_dropout",
    "prev_power_of_2",
    "remember_host_copy",
    "resolve_backend",
    "rms_norm",
    "select_backend",
    "set_static_max_seq_lens",
    "set_use_runtime_max_seq_len",
    "set_value_checks",
    "split_2D_jagged",
    "swish_layer_norm",
    "switch_to_contiguous_if_needed",
    "to_device",
]
