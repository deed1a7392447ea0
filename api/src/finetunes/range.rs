//! A number a request gives, within its bounds or refused naming the field.

use crate::error::{ApiError, ApiResult, Code};

/// `value` when it lies in `low..=high`, else a 400 `invalid_value` on `param`.
pub(super) fn check_range<T: PartialOrd + std::fmt::Display>(
    param: &str,
    value: T,
    low: T,
    high: T,
) -> ApiResult<T> {
    if value < low || value > high {
        return Err(ApiError::invalid(
            param,
            Code::InvalidValue,
            format!(
                "{param} must be {low} to {high}, not {}.",
                crate::quote::shown(&value.to_string())
            ),
        ));
    }
    Ok(value)
}
