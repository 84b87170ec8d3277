"""tzrec-acc: export and acceleration for tzrec models.

FX tracing helpers, export graph passes, AOTInductor, TensorRT, quantization and mixed
precision. Imports with only torch and tzrec-ops installed; TensorRT (``tzrec-acc[tensorrt]``)
and tzrec-gr (``tzrec-acc[gr]``) are loaded by the features that need them.
"""

__version__ = "0.1.0"
