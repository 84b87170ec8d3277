"""tzrec-acc: Export and acceleration for tzrec models: FX tracing, export passes, AOTInductor, TensorRT, quantization, mixed precision."""

__version__ = "0.1.0"
