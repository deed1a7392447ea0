//! [`JobQueue::inspect`](crate::JobQueue::inspect) on the scripted queue: every stored
//! job with the indexes it is a member of, the tenants the scheduler serves, and the
//! pools — read key by key, for invariant checks and debugging, never on a hot path.

use super::Queue;
use crate::Result;
use crate::job_queue::JobQueue;
use crate::model::Inspection;

impl Queue {
    /// Every key of the domain, read back as an [`Inspection`] (what
    /// [`JobQueue::inspect`] answers): a scan of the job records and the index each is in.
    pub(super) async fn inspect_keys(&self) -> Result<Inspection> {
        let p = self.domain.prefix();
        let mut ids = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(format!("{p}job:*"))
                .arg("COUNT")
                .arg(1000);
            let (next, keys): (u64, Vec<String>) = self.domain.scan_query("scan", &scan).await?;
            ids.extend(keys.iter().map(|k| k[p.len() + 4..].to_string()));
            if next == 0 {
                break;
            }
            cursor = next;
        }
        let members = |key: String| {
            let backend = self.domain.backend.clone();
            async move {
                let kind = if key.ends_with("cancelling") {
                    "SMEMBERS"
                } else {
                    "ZRANGE"
                };
                let mut cmd = redis::cmd(kind);
                cmd.arg(&key);
                if kind == "ZRANGE" {
                    cmd.arg(0).arg(-1);
                }
                backend
                    .query::<Vec<String>>(&cmd)
                    .await
                    .map(|v| v.into_iter().collect::<std::collections::HashSet<_>>())
            }
        };
        let mut indexes = Vec::new();
        for name in ["delayed", "leases", "suspect", "cancelling", "done", "dead"] {
            indexes.push((name, members(format!("{p}{name}")).await?));
        }
        let active_tenants = members(format!("{p}tenants")).await?.into_iter().collect();
        let mut ready_of = std::collections::HashMap::new();
        let mut out = Inspection {
            active_tenants,
            ..Inspection::default()
        };
        ids.sort();
        for id in ids {
            let Some(record) = self.get(&id).await? else {
                continue;
            };
            if !ready_of.contains_key(&record.tenant) {
                let ready = members(format!("{p}ready:{}", record.tenant)).await?;
                if !ready.is_empty() {
                    out.tenants_with_waiting.insert(record.tenant.clone());
                }
                ready_of.insert(record.tenant.clone(), ready);
            }
            let mut member_of = Vec::new();
            if ready_of[&record.tenant].contains(&id) {
                member_of.push("ready");
            }
            for (name, set) in &indexes {
                if set.contains(&id) {
                    member_of.push(*name);
                }
            }
            out.jobs.push((record, member_of));
        }
        let mut cmd = redis::cmd("SMEMBERS");
        cmd.arg(format!("{p}pools"));
        let pools: Vec<String> = self.domain.query(&cmd).await?;
        for pool in pools {
            let usage = self.pool_usage(&pool).await?;
            out.pools.push((pool, usage));
        }
        out.pools.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}
