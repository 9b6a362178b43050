"""User-facing errors. Every mistake a user can make raises a subclass of
`KvExportError` whose message says what to do; `assert` is kept for internal invariants."""


class KvExportError(Exception):
    """Base class of all errors caused by user input or environment."""


class UnsupportedModelError(KvExportError):
    """The architecture or one of its options is not supported (the message names the
    field and the supported values)."""


class ConfigError(KvExportError):
    """A config.json, recipe or option is malformed or out of range."""


class SourceError(KvExportError):
    """Model weights or tokenizer are missing, unreadable or refused."""


class BuildExistsError(KvExportError):
    """The output directory exists and --force was not given."""


class OutputError(KvExportError):
    """--out cannot be written: it holds something kvexport did not make (never replaced,
    even with --force), it is or contains the model source or the build, or its folder
    cannot be written; the message says what is there and what to do."""


class ManifestError(KvExportError):
    """A build directory has a missing, corrupt or incompatible manifest."""


class ValidationError(KvExportError):
    """Exported graphs disagree with transformers beyond the stated tolerance."""


class TensorRTUnavailableError(KvExportError):
    """TensorRT (the Python bindings) or a CUDA GPU is missing; the message names which
    one and how to get it (the ONNX part of a build is complete regardless)."""


class EngineBuildError(KvExportError):
    """TensorRT refused a graph or produced no engine."""


class ChecksumError(ManifestError):
    """A file of a build does not match the sha256 its manifest records (damaged or replaced
    after the build), or cannot be verified; the message names the file and what to do."""
