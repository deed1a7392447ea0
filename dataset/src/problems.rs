//! How validation names what is wrong: a problem is `(field, message)`, and the JSON
//! type of a value is said as JSON calls it.

use serde_json::Value;

/// A problem with one field of a line: `(field, message)`.
pub(crate) type FieldProblem = (String, String);

/// JSON type name for messages like "expected a string, got number".
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}
