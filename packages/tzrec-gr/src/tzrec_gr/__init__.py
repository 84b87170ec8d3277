"""tzrec-gr: HSTU generative-recommender modules over tzrec-ops.

STU layers and stacks with a functional KV cache (and the serving cache built on it), the
HSTU transducer, its input preprocessors, positional encoder, content/action encoders,
contextualized MLPs, output postprocessors, two end-to-end models (retrieval and ranking)
and their losses (:mod:`tzrec_gr.losses`), whose id tables sit behind one interface
(:mod:`tzrec_gr.embeddings`: ``nn.Embedding`` or a torchrec ``EmbeddingCollection``).
Inputs are plain jagged tensors (values + offsets); torchrec inputs go through
:mod:`tzrec_gr.torchrec_adapters`. Serving (:mod:`tzrec_gr.serving`) stands on the models and
is imported on its own; importing the models never imports it.
"""

from tzrec_gr.action_encoder import SimpleActionEncoder
from tzrec_gr.content_encoder import (
    ContentEncoder,
    MLPContentEncoder,
    PadContentEncoder,
    SliceContentEncoder,
)
from tzrec_gr.contextualize_mlps import (
    ContextualizedMLP,
    ParameterizedContextualizedMLP,
    SimpleContextualizedMLP,
)
from tzrec_gr.embeddings import EmbeddingTable, TorchrecEmbeddingTable, embedding_table
from tzrec_gr.hstu_transducer import HSTUTransducer, TransducerOutput
from tzrec_gr.item_attributes import ItemAttributeEmbedding
from tzrec_gr.layers import MLP, LayerNorm, Linear, SwishLayerNorm
from tzrec_gr.losses import multitask_bce_loss, next_item_targets, sampled_softmax_loss
from tzrec_gr.positional_encoder import HSTUPositionalEncoder
from tzrec_gr.postprocessors import (
    L2NormPostprocessor,
    LayerNormPostprocessor,
    OutputPostprocessor,
    TimestampLayerNormPostprocessor,
)
from tzrec_gr.preprocessors import (
    ContextualInterleavePreprocessor,
    ContextualProjection,
    InputPreprocessor,
    PreprocessorOutput,
    UIHPreprocessor,
)
from tzrec_gr.stu import (
    STU,
    KVCache,
    ServingCache,
    STULayer,
    STUOutput,
    STUStack,
    STUStackOutput,
)

__version__ = "0.1.0"

__all__ = [
    "ContentEncoder",
    "ContextualInterleavePreprocessor",
    "ContextualProjection",
    "ContextualizedMLP",
    "EmbeddingTable",
    "HSTUPositionalEncoder",
    "HSTUTransducer",
    "InputPreprocessor",
    "ItemAttributeEmbedding",
    "KVCache",
    "L2NormPostprocessor",
    "LayerNorm",
    "LayerNormPostprocessor",
    "Linear",
    "MLP",
    "MLPContentEncoder",
    "OutputPostprocessor",
    "PadContentEncoder",
    "ParameterizedContextualizedMLP",
    "PreprocessorOutput",
    "STU",
    "STULayer",
    "STUOutput",
    "STUStack",
    "STUStackOutput",
    "ServingCache",
    "SimpleActionEncoder",
    "SimpleContextualizedMLP",
    "SliceContentEncoder",
    "SwishLayerNorm",
    "TimestampLayerNormPostprocessor",
    "TorchrecEmbeddingTable",
    "TransducerOutput",
    "UIHPreprocessor",
    "embedding_table",
    "multitask_bce_loss",
    "next_item_targets",
    "sampled_softmax_loss",
]
