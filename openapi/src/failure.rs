//! Why a job failed, as a type: the dispatcher names the class, the queue stores its code
//! next to the reason, and the API shows the code to the tenant as `error.code`, so no
//! reader ever tells a failure by its sentence.
//!
//! Failures not yet named here are still told by the reason the dispatcher writes; they
//! move here as they become types.

use serde::{Deserialize, Serialize};

/// A class of job failure the dispatcher knows by type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// The platform refused to start the attempt as the pool describes it (a Job the
    /// cluster's API server answers with 4xx, a pool whose Job cannot be built): only
    /// the operator can help, by fixing the pool. The tenant is told so, never the
    /// platform's own words, which go to the operator's log.
    PoolMisconfigured,
}

impl FailureClass {
    /// Every class, in the order declared.
    pub const ALL: &'static [Self] = &[Self::PoolMisconfigured];

    /// Its stable code: stored by the queue, shown to tenants as `error.code`.
    pub fn code(self) -> &'static str {
        match self {
            Self::PoolMisconfigured => "pool_misconfigured",
        }
    }

    /// The class with this code (None: a code this build does not know).
    pub fn parse(code: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.code() == code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_match_serde() {
        for class in FailureClass::ALL {
            assert_eq!(FailureClass::parse(class.code()), Some(*class));
            assert_eq!(
                serde_json::to_value(class).ok(),
                Some(serde_json::Value::String(class.code().into()))
            );
        }
        assert_eq!(FailureClass::parse("training_failed"), None);
    }
}
