"""A fit's summary as a typed result: callers read its fields, the log reads one flat line of key=value
(`as_dict`; `items()` and `[key]` as a dict's, so a caller or test that reads the old keys keeps working).
`benchmarks/common.py` parses the "value head:" line by its keys, so the flat keys are an interface."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar, Iterator


class LogSummary:
    """Base of the summaries (dataclasses) that `fit_head`, `fit_before_training` and `fit_horizon_calibration`
    return. The default `as_dict`: the fields in order, each under its own name, a nested LogSummary flattened in
    its place, a None left out (the fit did not get that far) unless the field is named in `kept_none` (None is
    its value: e.g. a score that could not be computed)."""
    kept_none: ClassVar[tuple[str, ...]] = ()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, LogSummary):
                out.update(value.as_dict())
            elif value is not None or f.name in self.kept_none:
                out[f.name] = value
        return out

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(self.as_dict().items())

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]
