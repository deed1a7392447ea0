//! The REST service: native routes, OpenAI-compatible routes, tenants and the OpenAPI spec.
//!
//! Not built yet (issue 5). It will serve `/files`, `/finetunes`, `/v1/files`,
//! `/v1/fine_tuning/jobs`, SSE event streams, `/metrics` and `/openapi.json`.
