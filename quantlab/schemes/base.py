"""Base classes of scheme configs: a dataclass whose fields are the whole public
surface of a scheme; it round-trips to a plain dict (MLflow params, export
manifests) with its type name. A scheme's fields declare their valid values
in ``metadata`` (:func:`quantlab.config_check.validate` reads them, as it does every
config's), checked when the config is constructed: in Python as on the command
line, a bad value is one line naming the scheme (``LABEL``), field and value."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from quantlab.config_check import validate


@dataclass
class _Scheme:
    # the module whose import registers this config's handler (registry.register_weights /
    # register_kv); imported the first time a config of this type is applied
    HANDLER: ClassVar[str] = ""
    LABEL: ClassVar[str] = "scheme"  # how a refusal names it: "int4 group_size 48; valid: ..."

    def __post_init__(self) -> None:
        validate(self)

    def short_name(self) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, **dataclasses.asdict(self)}

    def calibration_set(self) -> str | None:
        """The ``calibration/`` set applying this scheme reads, or None."""
        return getattr(self, "calibration", None)


@dataclass
class WeightScheme(_Scheme):
    """Base of all weight-scheme configs. Subclasses add their knobs as fields."""
    # True: the scheme keeps the quantization of a checkpoint made elsewhere (``as-is``), so the
    # point's model must be such an artifact (quantlab.artifacts)
    KEEPS_ARTIFACT: ClassVar[bool] = False

    def for_model(self, model: Any) -> "WeightScheme":
        """This scheme as it applies to the point's model config ``model``:
        itself, unless the scheme reads something from the model's files
        when the point is composed. ``ValueError`` in one line."""
        return self

    def float_bytes(self) -> int:
        """Bytes per weight of the widest float copy a point of this scheme
        keeps (a quantized scheme's compute dtype; a float scheme's own)."""
        return 4 if getattr(self, "compute_dtype", "bfloat16") == "float32" else 2


@dataclass
class KVScheme(_Scheme):
    """Base of all KV-cache scheme configs."""
