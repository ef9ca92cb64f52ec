//! What a request asks its output to be: OpenAI's `response_format` (`text`,
//! `json_object`, `json_schema`) and llama.cpp's `grammar` (Lark, as `llguidance` reads
//! it) and `regex`, read into a [`ConstraintSpec`] the model's grammars compile. At most
//! one per request; anything malformed is a 400 naming its field.

use model::constraint::ConstraintSpec;
use serde_json::Value;

use super::api::ApiError;

/// The constraint fields of a request, as sent.
pub struct FormatFields<'a> {
    pub response_format: Option<&'a Value>,
    pub grammar: Option<&'a Value>,
    pub regex: Option<&'a Value>,
}

/// The one constraint the fields ask for (with the field that asked), or none.
pub fn constraint_spec(
    fields: &FormatFields<'_>,
) -> Result<Option<(ConstraintSpec, &'static str)>, ApiError> {
    let mut asked = Vec::new();
    if let Some(spec) = response_format(fields.response_format)? {
        asked.push((spec, "response_format"));
    }
    if let Some(text) = text_field(fields.grammar, "grammar")? {
        asked.push((ConstraintSpec::Lark(text), "grammar"));
    }
    if let Some(text) = text_field(fields.regex, "regex")? {
        asked.push((ConstraintSpec::Regex(text), "regex"));
    }
    if asked.len() > 1 {
        let names: Vec<&str> = asked.iter().map(|&(_, name)| name).collect();
        return Err(ApiError::bad(format!(
            "one output constraint per request, got {}",
            names.join(" and ")
        ))
        .param(asked[1].1));
    }
    Ok(asked.pop())
}

/// `grammar` or `regex`: a non-empty string, or nothing (`null`, absent).
fn text_field(value: Option<&Value>, name: &'static str) -> Result<Option<String>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) if !text.trim().is_empty() => Ok(Some(text.clone())),
        Some(other) => Err(ApiError::bad(format!(
            "{name} must be a non-empty string, got {other}"
        ))
        .param(name)),
    }
}

/// `response_format`: `{"type": "text"}` asks for nothing, `{"type": "json_object"}` for
/// any object (or, as llama.cpp reads it, one of its `schema`), `{"type":
/// "json_schema", "json_schema": {"name": …, "schema": {…}, "strict": …}}` for JSON of
/// the schema. The schema is enforced whether `strict` is set or not.
fn response_format(value: Option<&Value>) -> Result<Option<ConstraintSpec>, ApiError> {
    let bad = |message: String| Err(ApiError::bad(message).param("response_format"));
    let format = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(format) => format,
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => match format.get("schema") {
            None | Some(Value::Null) => Ok(Some(ConstraintSpec::JsonObject)),
            Some(schema) => Ok(Some(ConstraintSpec::JsonSchema(schema.clone()))),
        },
        Some("json_schema") => {
            let Some(spec) = format.get("json_schema").filter(|s| s.is_object()) else {
                return bad(
                    "response_format json_schema needs a json_schema object with a schema".into(),
                );
            };
            if !matches!(
                spec.get("strict"),
                None | Some(Value::Null | Value::Bool(_))
            ) {
                return bad("response_format json_schema.strict must be a boolean".into());
            }
            match spec.get("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(ConstraintSpec::JsonSchema(schema.clone())))
                }
                Some(other) => bad(format!(
                    "response_format json_schema.schema must be a JSON schema object, got {other}"
                )),
                None => bad("response_format json_schema.schema is required".into()),
            }
        }
        _ => bad(format!(
            "response_format must be an object whose type is \"text\", \"json_object\" or \
             \"json_schema\", got {format}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(body: Value) -> Result<Option<(ConstraintSpec, &'static str)>, ApiError> {
        constraint_spec(&FormatFields {
            response_format: body.get("response_format"),
            grammar: body.get("grammar"),
            regex: body.get("regex"),
        })
    }

    fn refused(body: Value) -> &'static str {
        match spec(body.clone()) {
            Err(e) => e.param_name().expect("the field is named"),
            Ok(s) => panic!("{body} passed: {s:?}"),
        }
    }

    #[test]
    fn each_field_gives_its_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({}), None),
            (json!({"response_format": null, "grammar": null}), None),
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some((ConstraintSpec::JsonObject, "response_format")),
            ),
            (
                json!({"response_format": {"type": "json_object", "schema": schema}}),
                Some((
                    ConstraintSpec::JsonSchema(schema.clone()),
                    "response_format",
                )),
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some((
                    ConstraintSpec::JsonSchema(schema.clone()),
                    "response_format",
                )),
            ),
            (
                json!({"grammar": "start: \"a\""}),
                Some((ConstraintSpec::Lark("start: \"a\"".into()), "grammar")),
            ),
            (
                json!({"regex": "[0-9]+", "response_format": {"type": "text"}}),
                Some((ConstraintSpec::Regex("[0-9]+".into()), "regex")),
            ),
        ];
        for (body, expected) in cases {
            assert_eq!(spec(body.clone()).ok(), Some(expected), "{body}");
        }
    }

    #[test]
    fn malformed_or_several_constraints_are_refused_by_name() {
        for (body, field) in [
            (
                json!({"response_format": {"type": "sound"}}),
                "response_format",
            ),
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"schema": "object"}}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"schema": {}, "strict": "yes"}}}),
                "response_format",
            ),
            (json!({"grammar": ""}), "grammar"),
            (json!({"grammar": 3}), "grammar"),
            (json!({"regex": ["a"]}), "regex"),
            (
                json!({"response_format": {"type": "json_object"}, "regex": "a"}),
                "regex",
            ),
            (json!({"grammar": "start: \"a\"", "regex": "a"}), "regex"),
        ] {
            assert_eq!(refused(body.clone()), field, "{body}");
        }
    }
}
