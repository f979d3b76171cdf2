"""What every request schema of the API shares: strict models (unknown fields are 400s), the UTF-8 check of a
request body, and the error that names the field a 400 is about."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator


def _find_unencodable(value, path: str) -> str | None:
    """Path of the first string that is not valid Unicode (lone surrogates from JSON escapes like \\ud800)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for k, v in value.items():
            if (hit := _find_unencodable(v, f"{path}.{k}" if path else str(k))) is not None:
                return hit
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (hit := _find_unencodable(v, f"{path}.{i}")) is not None:
                return hit
    return None


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestModel(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        bad = _find_unencodable(data, "")
        if bad is not None:
            raise UnsupportedFieldError(bad, f"{bad}: the text is not valid UTF-8 (unpaired surrogate)")
        return data


class UnsupportedFieldError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def metadata_limits(metadata: dict | None) -> dict | None:
    """OpenAI's limits on `metadata` (chat and responses): keys at most 64 characters, values at most 512."""
    if metadata and any(len(k) > 64 or len(x) > 512 for k, x in metadata.items()):
        raise ValueError("metadata keys are at most 64 characters and values at most 512")
    return metadata
