//! The range and shape checks declared beside the fields (`#[validate(…)]`, the `validator`
//! crate, as svix declares its configuration's), turned into a [`ConfigError`] that names the
//! key in the configuration's own dotted spelling (`limits.max_sandboxes`).

use std::borrow::Cow;

use validator::{ValidationError, ValidationErrors, ValidationErrorsKind};

use super::ConfigError;

/// The first problem of `errors` (by key, so the same configuration always reports the same
/// one) as a [`ConfigError::Invalid`]; `None` when there is none.
pub(super) fn first_problem(errors: &ValidationErrors) -> Option<ConfigError> {
    let mut problems = Vec::new();
    collect("", errors, &mut problems);
    problems.sort();
    problems
        .into_iter()
        .next()
        .map(|(key, message)| ConfigError::Invalid { key, message })
}

/// Every (dotted key, message) of `errors`, nested tables' keys prefixed with `prefix`.
fn collect(prefix: &str, errors: &ValidationErrors, out: &mut Vec<(String, String)>) {
    for (field, kind) in errors.errors() {
        let key = if prefix.is_empty() {
            field.to_string()
        } else {
            format!("{prefix}.{field}")
        };
        match kind {
            ValidationErrorsKind::Struct(inner) => collect(&key, inner, out),
            ValidationErrorsKind::List(items) => {
                for inner in items.values() {
                    collect(&key, inner, out);
                }
            }
            ValidationErrorsKind::Field(problems) => {
                out.extend(problems.iter().map(|p| {
                    let message = p.message.as_ref().unwrap_or(&p.code);
                    (key.clone(), message.to_string())
                }));
            }
        }
    }
}

/// A problem found by a custom check, with the message the operator reads.
pub(super) fn problem(message: impl Into<Cow<'static, str>>) -> ValidationError {
    ValidationError::new("invalid").with_message(message.into())
}
