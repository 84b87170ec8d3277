"""An example tzrec-gr model plugin: ``one-layer-hstu``, registered through the
``tzrec_gr.models`` entry point of the distribution ``tzrec-gr-model-example``.

Nothing is imported here: tzrec-gr imports :mod:`tzrec_gr_model_example.model` (which
registers the model) when it first looks a model up.
"""

__all__: list = []
