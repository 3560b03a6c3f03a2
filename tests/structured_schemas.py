"""Held-out JSON schemas for the structured-output tests: nested objects, arrays, enums, numbers
with bounds, required fields, a pattern, a const, a nullable type. Strings carry maxLength and
arrays maxItems, so a random-weight model completes each within the tests' max_tokens (an
unbounded string is valid JSON Schema too; it only needs a model that closes it)."""


HELD_OUT_SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "email": {"type": "string", "maxLength": 20}},
            "required": ["id"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"}},
     "required": ["user", "score", "active"], "additionalProperties": False},
    {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 50}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["open", "paid", "shipped"]}},
     "required": ["items", "status"], "additionalProperties": False},
    {"type": "object", "properties": {
        "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        "wind": {"type": "object", "properties": {
            "speed_kmh": {"type": "integer", "minimum": 0, "maximum": 300},
            "direction": {"enum": ["N", "E", "S", "W"]}},
            "required": ["speed_kmh", "direction"], "additionalProperties": False},
        "note": {"type": ["string", "null"], "maxLength": 16}},
     "required": ["temperature_c", "conditions", "wind"], "additionalProperties": False},
    {"type": "array", "minItems": 2, "maxItems": 5,
     "items": {"type": "integer", "minimum": -100, "maximum": 100}},
    {"type": "object", "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 10},
        "matrix": {"type": "array", "maxItems": 2, "items": {
            "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
        "meta": {"type": "object", "properties": {"version": {"const": 2}},
                 "required": ["version"], "additionalProperties": False}},
     "required": ["title", "matrix", "meta"], "additionalProperties": False},
]
