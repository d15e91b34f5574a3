"""JSON Schema export: `python -m cv_mutations.schema --write` regenerates `schemas/`.

The checked-in files are the contract for non-Python clients; a test fails when they drift from
the models. `PublishedJsonSchema` is the generator of every schema published (these files and
the OpenAPI document's components).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import (
    DefsRef,
    GenerateJsonSchema,
    JsonSchemaMode,
    JsonSchemaValue,
)
from pydantic_core import CoreSchema

from cv_mutations.ops import OP_ADAPTER, NodeDelete, NodeIncrement, NodeInsert, NodeMove, NodeUpdate

__all__ = ["SCHEMA_DIR", "PublishedJsonSchema", "render_schemas"]

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"

_MODELS: dict[str, type[BaseModel]] = {
    "node.insert": NodeInsert,
    "node.move": NodeMove,
    "node.delete": NodeDelete,
    "node.update": NodeUpdate,
    "node.increment": NodeIncrement,
}


#: Keywords whose values are JSON data, not schemas: never walked for `properties`.
_DATA_KEYWORDS = frozenset({"default", "const", "enum", "examples"})


def _optional_fields_carry_no_default(node: Any) -> None:
    """An optional property (not in `required`) loses its `default`; a default other than null
    is said in its `description` instead ("When absent: ...").

    Generators read a property with a `default` as one that is always present: openapi-typescript
    (default options) types it as required, so an ordinary enqueue, which leaves `job_id` out, did
    not compile. The server fills in every default itself, so a client that leaves a member out
    loses nothing (tests/outside/test_openapi_typescript.py,
    tests/mutations/test_schema_parity.py).
    """
    if isinstance(node, list):
        for item in node:
            _optional_fields_carry_no_default(item)
        return
    if not isinstance(node, dict):
        return
    properties = node.get("properties")
    if isinstance(properties, dict):
        required = set(node.get("required", ()))
        for name, prop in properties.items():
            if name in required or not isinstance(prop, dict) or "default" not in prop:
                continue
            default = prop.pop("default")
            if default is not None:
                said = f"When absent: `{json.dumps(default, sort_keys=True)}`."
                prop["description"] = (
                    f"{prop['description']} {said}" if "description" in prop else said
                )
    for key, value in node.items():
        if key not in _DATA_KEYWORDS:
            _optional_fields_carry_no_default(value)


class PublishedJsonSchema(GenerateJsonSchema):
    """pydantic's JSON Schema generator, with optional members optional for every reader:
    `_optional_fields_carry_no_default` applied to each schema and definition it generates."""

    def generate(self, schema: CoreSchema, mode: JsonSchemaMode = "validation") -> JsonSchemaValue:
        generated = super().generate(schema, mode)
        _optional_fields_carry_no_default(generated)
        return generated

    def generate_definitions(
        self, inputs: Sequence[tuple[Any, JsonSchemaMode, CoreSchema]]
    ) -> tuple[dict[tuple[Any, JsonSchemaMode], JsonSchemaValue], dict[DefsRef, JsonSchemaValue]]:
        mapping, definitions = super().generate_definitions(inputs)
        _optional_fields_carry_no_default(definitions)
        _optional_fields_carry_no_default(list(mapping.values()))
        return mapping, definitions


def _with_id(schema: dict[str, Any], name: str) -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://cv-workspace.dev/schemas/{name}",
        **schema,
    }


def _union() -> dict[str, Any]:
    schema = OP_ADAPTER.json_schema(mode="validation", schema_generator=PublishedJsonSchema)
    # pydantic adds OpenAPI's `discriminator` (with `mapping`), which is no JSON Schema keyword:
    # Ajv refuses to compile the union with its defaults ("unknown keyword") and with its
    # `discriminator` option too ("mapping is not supported"). `oneOf` over branches that each
    # require their own `type` const already picks exactly one op type.
    schema.pop("discriminator", None)
    return schema


def render_schemas() -> dict[str, str]:
    """File name → file text for every op and for the union."""
    files: dict[str, Any] = {}
    for op_type, model in _MODELS.items():
        name = f"{op_type}.schema.json"
        schema = model.model_json_schema(mode="validation", schema_generator=PublishedJsonSchema)
        files[name] = _with_id(schema, name)
    files["op.schema.json"] = _with_id(_union(), "op.schema.json")
    return {name: json.dumps(body, indent=2, sort_keys=True) + "\n" for name, body in files.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cv_mutations.schema", description=__doc__)
    parser.add_argument("--write", action="store_true", help="write the schemas into schemas/")
    parser.add_argument("--check", action="store_true", help="exit 1 if schemas/ is out of date")
    parser.add_argument("--dir", type=Path, default=SCHEMA_DIR)
    args = parser.parse_args(argv)
    rendered = render_schemas()
    # Schema files no model renders any more (a renamed or dropped op type): `--write` deletes
    # them, so `--check` must count them as drift.
    stale = sorted({p.name for p in args.dir.glob("*.schema.json")} - set(rendered))
    if args.write:
        args.dir.mkdir(parents=True, exist_ok=True)
        for name in stale:
            (args.dir / name).unlink()
        for name, text in rendered.items():
            (args.dir / name).write_text(text, encoding="utf-8")
        return 0
    if args.check:
        drift = stale + [
            name
            for name, text in rendered.items()
            if not (args.dir / name).exists() or (args.dir / name).read_text("utf-8") != text
        ]
        if drift:
            print(f"schemas out of date: {drift}; run python -m cv_mutations.schema --write")
            return 1
        return 0
    json.dump({k: json.loads(v) for k, v in rendered.items()}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
