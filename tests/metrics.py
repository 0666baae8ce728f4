"""The tests' one reader of a Prometheus text exposition, on prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["label_names", "sample", "total"]


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels are exactly ``labels``; None when the series is
    not exported (absent is not zero: a dashboard shows "no data", and a test should tell the two apart)."""
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    return None


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels`` (0.0 when none is exported:
    a sum over no series is zero), e.g. a counter over all its outcomes."""
    values = [
        float(found.value)
        for family in text_string_to_metric_families(text)
        for found in family.samples
        if found.name == name and labels.items() <= found.labels.items()
    ]
    return float(sum(values))


def label_names(text: str) -> dict[str, set[str]]:
    """Every sample name exported, with the label names its series carry (what a query can select)."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            names.setdefault(found.name, set()).update(found.labels)
    return names
