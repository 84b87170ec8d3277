import pytest

from tzrec_gr.file_formats import FORMATS, LOG_ONLY, format_of
from tzrec_gr.serving.files import INPUT_FORMATS


@pytest.mark.parametrize(
    "name, expected",
    [
        ("events.parquet", "parquet"), ("part-0.PQ", "parquet"), ("log.csv", "csv"),
        ("log.csv.gz", "csv"), ("log.TSV.GZ", "tsv"), ("a.b.jsonl", "json"),
        ("log.ndjson.gz", "json"), ("schema.json", "json"), ("Video.txt", "text"),
        ("Beauty.seq", "sequences"), ("Beauty.seq.gz", "sequences"),
        ("README.md", None), ("notes", None), ("log.gz", None), ("backup.tar.gz", None),
    ],
)
def test_the_format_goes_by_the_suffix_before_gz(name, expected):
    assert format_of(name) == expected


def test_every_suffix_is_lower_case_with_its_dot():
    assert all(suffix.startswith(".") and suffix == suffix.lower() for suffix in FORMATS)


def test_the_event_log_only_formats_are_no_prediction_input():
    assert LOG_ONLY <= set(FORMATS.values())
    assert not LOG_ONLY & set(INPUT_FORMATS.values())
    assert set(INPUT_FORMATS.values()) | LOG_ONLY == set(FORMATS.values())
