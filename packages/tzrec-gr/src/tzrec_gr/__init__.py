"""tzrec-gr: HSTU generative-recommender modules: STU layers and stacks with KV cache, the HSTU transducer, encoders and models."""

__version__ = "0.1.0"
