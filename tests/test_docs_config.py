"""docs/CONFIG.md is generated from the config dataclasses and must not drift from them."""

from pathlib import Path

from vitscope.study.config import DatasetConfig, ModelConfig, StudyConfig, schema_markdown


def test_config_reference_is_current_and_documents_every_key():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md").read_text()
    assert doc.strip() == schema_markdown().strip(), "regenerate: python tools/config_schema.py > docs/CONFIG.md"
    import dataclasses

    for cls in (StudyConfig, ModelConfig, DatasetConfig):
        for f in dataclasses.fields(cls):
            row = next(line for line in doc.splitlines() if line.startswith(f"| `{f.name}` |"))
            assert row.rstrip(" |").split("|")[-1].strip(), f"{cls.__name__}.{f.name} has no description"
