"""Compatibility shim: Triton model repositories generated before runtime/ was split into
subpackages import `kvexport.runtime.triton_model.TritonPythonModel` from their
`1/model.py`; the model now lives in runtime/serving/triton_model.py."""

from .serving.triton_model import *  # noqa: F401,F403
from .serving.triton_model import TritonPythonModel  # noqa: F401
