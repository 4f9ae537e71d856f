"""JSON schemas for the structured-output tests: every feature the issue names, each schema
bounding its output (maxLength, maxItems, number ranges) so a small model can finish it."""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any):
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_object": _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "boolean_field": _obj({"done": {"type": "boolean"}}),
    "integer_range": _obj({"n": {"type": "integer", "minimum": -50, "maximum": 50}}),
    "exclusive_range": _obj(
        {"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}
    ),
    "number_range": _obj({"x": {"type": "number", "minimum": 0, "maximum": 1}}),
    "string_enum": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "mixed_enum": _obj({"v": {"enum": [1, "two", None, True]}}),
    "const": _obj(
        {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0, "maximum": 9}}
    ),
    "nested_object": _obj(
        {
            "user": _obj(
                {
                    "name": _NAME,
                    "address": _obj(
                        {"city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
                    ),
                }
            )
        }
    ),
    "array_min_max": _obj(
        {"tags": {"type": "array", "items": _NAME, "minItems": 2, "maxItems": 3}}
    ),
    "array_of_objects": _obj(
        {
            "points": {
                "type": "array",
                "items": _obj(
                    {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    }
                ),
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),
    "array_exact": _obj(
        {
            "rgb": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 255},
                "minItems": 3,
                "maxItems": 3,
            }
        }
    ),
    "tuple_prefix_items": _obj(
        {
            "pair": {
                "type": "array",
                "prefixItems": [_NAME, {"type": "integer", "minimum": 0, "maximum": 99}],
                "items": False,
            }
        }
    ),
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 4,
    },
    "any_of": _obj(
        {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 99},
                    {"type": "string", "maxLength": 8},
                ]
            }
        }
    ),
    "any_of_objects": _obj(
        {
            "shape": {
                "anyOf": [
                    _obj(
                        {
                            "kind": {"const": "circle"},
                            "r": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                    _obj(
                        {
                            "kind": {"const": "square"},
                            "side": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                ]
            }
        }
    ),
    "one_of": _obj(
        {
            "id": {
                "oneOf": [
                    {"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "string", "pattern": "^[a-z]{3}$"},
                ]
            }
        }
    ),
    "ref_defs": {
        "$defs": {
            "person": _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 99}})
        },
        **_obj({"author": {"$ref": "#/$defs/person"}, "editor": {"$ref": "#/$defs/person"}}),
    },
    "ref_in_array": {
        "$defs": {
            "item": _obj(
                {
                    "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                }
            )
        },
        **_obj(
            {
                "items": {
                    "type": "array",
                    "items": {"$ref": "#/$defs/item"},
                    "minItems": 1,
                    "maxItems": 2,
                }
            }
        ),
    },
    "ref_chain": {
        "$defs": {
            "leaf": {"type": "integer", "minimum": 0, "maximum": 9},
            "pair": _obj({"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}}),
        },
        **_obj({"root": {"$ref": "#/$defs/pair"}}),
    },
    "string_pattern": _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
    "phone_pattern": _obj(
        {"phone": {"type": "string", "pattern": "^\\+1 [0-9]{3}-[0-9]{3}-[0-9]{4}$"}}
    ),
    "format_date": _obj({"day": {"type": "string", "format": "date"}}),
    "format_date_array": _obj(
        {"days": {"type": "array", "items": {"type": "string", "format": "date"}, "maxItems": 2}}
    ),
    "format_uuid": _obj({"id": {"type": "string", "format": "uuid"}}),
    # Not "ipv4": xgrammar's ipv4 accepts octets with leading zeros ("022"), which Python's
    # ipaddress (and so jsonschema's format check) rejects.
    "format_nullable_date": _obj({"since": {"type": ["string", "null"], "format": "date"}}),
    "string_min_max_length": _obj({"word": {"type": "string", "minLength": 3, "maxLength": 6}}),
    "nullable_type_list": _obj({"nick": {"type": ["string", "null"], "maxLength": 10}}),
    "nullable_any_of": _obj(
        {"score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "null"}]}}
    ),
    "optional_fields": _obj(
        {
            "name": _NAME,
            "email": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        required=["name"],
    ),
    "all_optional": _obj(
        {"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        required=[],
    ),
    "additional_properties_false_nested": _obj(
        {
            "meta": _obj(
                {
                    "version": {"type": "integer", "minimum": 1, "maximum": 9},
                    "stable": {"type": "boolean"},
                }
            )
        }
    ),
    "min_max_properties": {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "propertyNames": {"pattern": "^[a-z]{1,4}$"},
        "minProperties": 1,
        "maxProperties": 2,
    },
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "boolean"}})})})}),
    "mixed_everything": {
        "$defs": {"tag": {"enum": ["new", "sale", "hot"]}},
        **_obj(
            {
                "title": _NAME,
                "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2},
                "discount": {
                    "anyOf": [{"type": "integer", "minimum": 0, "maximum": 90}, {"type": "null"}]
                },
                "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
            },
            required=["title", "price", "sku"],
        ),
    },
}
