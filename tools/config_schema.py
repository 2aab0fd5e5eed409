"""Write the study-config reference: `python tools/config_schema.py > docs/CONFIG.md` (tests/test_docs_config.py
checks that the file is current)."""

from vitscope.study.config import schema_markdown

print(schema_markdown())
