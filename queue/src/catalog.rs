//! The catalog: what the service keeps beyond a job's life in the queue — files, API
//! keys, fine-tune records, models — as JSON entries of a *kind* per *owner* (a tenant),
//! listed newest first with a cursor. It lives on the queue's backend (Redis or the
//! embedded file), so `tuneq up` needs no other store and a restart loses nothing.
//!
//! Kinds, owners and ids are checked identifiers, never free text: they become parts of
//! key names.

use crate::reply::{int, text, unsigned};
use crate::scripted::Queue;
use crate::{QueueError, Result};
use async_trait::async_trait;
use redis::Value;

/// One catalog entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its id within (kind, owner).
    pub id: String,
    /// The JSON the caller stored.
    pub body: String,
    /// When it was created (queue clock, Unix ms).
    pub created_ms: u64,
}

/// How a [`Catalog::swap_entry`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Swap {
    /// The body was the expected one and is now the new one.
    Swapped,
    /// The body had changed: nothing was written.
    Changed,
    /// There is no such entry.
    Missing,
}

/// A page of entries, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Page {
    /// The entries.
    pub entries: Vec<Entry>,
    /// Whether older entries follow the last one.
    pub has_more: bool,
}

/// Checks that `value` can be part of a key: 1–128 of `A-Z a-z 0-9 . _ -`.
pub fn check_identifier(field: &'static str, value: &str) -> Result<()> {
    let ok = !value.is_empty()
        && value.len() <= 128
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(QueueError::Invalid {
            field,
            message: format!(
                "{value:?} must be 1 to 128 characters of A-Z, a-z, 0-9, '.', '_', '-'"
            ),
        })
    }
}

/// Entries of a kind per owner.
#[async_trait]
pub trait Catalog: Send + Sync {
    /// Stores a new entry; false (and nothing changed) if the id is taken.
    async fn create_entry(&self, kind: &str, owner: &str, id: &str, body: &str) -> Result<bool>;
    /// The entry, or None.
    async fn get_entry(&self, kind: &str, owner: &str, id: &str) -> Result<Option<Entry>>;
    /// Replaces an entry's body; false if there is no such entry.
    async fn update_entry(&self, kind: &str, owner: &str, id: &str, body: &str) -> Result<bool>;
    /// Compare-and-set: replaces the entry's body with `body` only if it is still
    /// `expected`. Several writers that each read, change and swap lose no one's change:
    /// the one whose swap fails reads again. A repeat after a lost reply reports the swap.
    async fn swap_entry(
        &self,
        kind: &str,
        owner: &str,
        id: &str,
        expected: &str,
        body: &str,
    ) -> Result<Swap>;
    /// Deletes an entry; false if there was none.
    async fn delete_entry(&self, kind: &str, owner: &str, id: &str) -> Result<bool>;
    /// Up to `limit` entries created before `after` (an entry id; None starts from the
    /// newest). An `after` that is not an entry is refused as invalid.
    async fn list_entries(
        &self,
        kind: &str,
        owner: &str,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Page>;
    /// How many entries (kind, owner) holds.
    async fn count_entries(&self, kind: &str, owner: &str) -> Result<u64>;
}

fn check(kind: &str, owner: &str, id: &str) -> Result<()> {
    check_identifier("kind", kind)?;
    check_identifier("owner", owner)?;
    check_identifier("id", id)
}

impl Queue {
    /// Runs the catalog script.
    async fn catalog_script(&self, args: &[String]) -> Result<Vec<Value>> {
        self.domain.call(&self.scripts.catalog, args).await
    }

    /// The key of one catalog entry (its parts are checked identifiers).
    fn catalog_key(&self, kind: &str, owner: &str, id: &str) -> String {
        self.domain.key(&format!("cat:{kind}:{owner}:{id}"))
    }

    /// Creates or updates one entry's body; true when the script did it (0 = done).
    async fn write_entry(
        &self,
        op: &str,
        kind: &str,
        owner: &str,
        id: &str,
        body: &str,
    ) -> Result<bool> {
        check(kind, owner, id)?;
        let reply = self.catalog_call(op, kind, owner, id, &[body]).await?;
        Ok(int(reply.first())? == 0)
    }

    async fn catalog_call(
        &self,
        op: &str,
        kind: &str,
        owner: &str,
        id: &str,
        extra: &[&str],
    ) -> Result<Vec<Value>> {
        let mut args = vec![
            op.to_string(),
            kind.to_string(),
            owner.to_string(),
            id.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        self.catalog_script(&args).await
    }
}

#[async_trait]
impl Catalog for Queue {
    async fn create_entry(&self, kind: &str, owner: &str, id: &str, body: &str) -> Result<bool> {
        // A repeat after a lost reply finds its own entry and reports "taken"; callers
        // that create with fresh random ids can treat that as created.
        self.write_entry("create", kind, owner, id, body).await
    }

    async fn get_entry(&self, kind: &str, owner: &str, id: &str) -> Result<Option<Entry>> {
        check(kind, owner, id)?;
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.catalog_key(kind, owner, id))
            .arg("body")
            .arg("created_ms");
        let (body, created): (Option<String>, Option<String>) = self.domain.query(&cmd).await?;
        match (body, created) {
            (Some(body), Some(created)) => Ok(Some(Entry {
                id: id.to_string(),
                body,
                created_ms: created.parse::<f64>().map(|f| f as u64).unwrap_or_default(),
            })),
            _ => Ok(None),
        }
    }

    async fn update_entry(&self, kind: &str, owner: &str, id: &str, body: &str) -> Result<bool> {
        self.write_entry("update", kind, owner, id, body).await
    }

    async fn swap_entry(
        &self,
        kind: &str,
        owner: &str,
        id: &str,
        expected: &str,
        body: &str,
    ) -> Result<Swap> {
        check(kind, owner, id)?;
        let reply = self
            .catalog_call("swap", kind, owner, id, &[expected, body])
            .await?;
        match int(reply.first())? {
            0 => Ok(Swap::Swapped),
            1 => Ok(Swap::Changed),
            _ => Ok(Swap::Missing),
        }
    }

    async fn delete_entry(&self, kind: &str, owner: &str, id: &str) -> Result<bool> {
        check(kind, owner, id)?;
        let reply = self.catalog_call("delete", kind, owner, id, &[]).await?;
        Ok(int(reply.first())? == 0)
    }

    async fn list_entries(
        &self,
        kind: &str,
        owner: &str,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Page> {
        check_identifier("kind", kind)?;
        check_identifier("owner", owner)?;
        if let Some(after) = after {
            check_identifier("after", after)?;
        }
        let limit = limit.clamp(1, 1000).to_string();
        let reply = self
            .catalog_call(
                "list",
                kind,
                owner,
                "-",
                &[after.unwrap_or_default(), &limit],
            )
            .await?;
        if int(reply.first())? != 0 {
            return Err(QueueError::Invalid {
                field: "after",
                message: format!(
                    "{:?} is not an entry of this list",
                    after.unwrap_or_default()
                ),
            });
        }
        let has_more = matches!(reply.get(1), Some(Value::Int(1)));
        let entries = reply[2..]
            .chunks(3)
            .map(|c| {
                Ok(Entry {
                    id: text(c.first())?,
                    body: text(c.get(1))?,
                    created_ms: unsigned(c.get(2))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Page { entries, has_more })
    }

    async fn count_entries(&self, kind: &str, owner: &str) -> Result<u64> {
        check_identifier("kind", kind)?;
        check_identifier("owner", owner)?;
        let reply = self.catalog_call("count", kind, owner, "-", &[]).await?;
        match reply.get(1) {
            Some(Value::Int(n)) => Ok(u64::try_from(*n).unwrap_or(0)),
            other => Err(QueueError::Protocol(format!("catalog count: {other:?}"))),
        }
    }
}
