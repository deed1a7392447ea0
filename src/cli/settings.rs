//! Settings of the services (`tuneq up`, `tuneq api`, `tuneq dispatcher`): each has one
//! typed settings struct (its clap `Args`), filled from, highest first, its flags, the
//! environment (`TUNEQ_…`), a config file (`--config FILE` or `TUNEQ_CONFIG`), and the
//! built-in defaults. `tuneq config show SERVICE …` prints the effective settings, where
//! each came from, and secrets masked.
//!
//! A config file is TOML with one table per service, keyed by the flags' long names:
//!
//! ```toml
//! [api]
//! port = 8080
//! store = "s3://tuneq-data/prod"
//! pools = "/etc/tuneq/pools.toml"
//! job-retention = "14d"
//! ```
//!
//! A key no flag of that service has is refused, naming the key and the file, so a typo
//! never silently leaves a default in place. A config file that holds a secret must be
//! readable by its owner only.

use super::BadInput;
use anyhow::{Context, Result};
use std::path::Path;
use std::time::Duration;

/// The services a config file has a table for.
pub const SERVICES: [&str; 4] = ["up", "api", "serve", "dispatcher"];

/// A secret setting (a password, a key, a URL that may carry a password): it never
/// prints, in `Debug` or `Display`, so settings can be logged whole.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The secret itself, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_string()))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MASK)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MASK)
    }
}

/// What a masked secret prints as.
const MASK: &str = "********";

/// A duration setting written the human way (`90s`, `30m`, `7d`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span(pub Duration);

impl std::str::FromStr for Span {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        humantime::parse_duration(s.trim())
            .map(Span)
            .map_err(|e| format!("{e} (write e.g. `90s`, `30m`, `7d`)"))
    }
}

impl Span {
    fn millis(self) -> u64 {
        u64::try_from(self.0.as_millis()).unwrap_or(u64::MAX)
    }
}

/// The queue settings every service that opens the queue shares. The API and the
/// dispatchers of one deployment must agree on them: each runs the queue's operations
/// with its own copy.
#[derive(Debug, Clone, clap::Args)]
pub struct QueueArgs {
    /// The queue's Redis (`redis://…`; comma-separated seeds for a Cluster). `tuneq up`
    /// keeps the queue in its embedded file without it.
    #[arg(
        long,
        env = "TUNEQ_REDIS_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub redis: Option<Secret>,
    /// The Redis password, set on the URL(s) above (percent-encoded: any character
    /// works). Give it through the environment, not the command line, which `ps` shows.
    #[arg(
        long,
        env = "TUNEQ_REDIS_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD"
    )]
    pub redis_password: Option<Secret>,
    /// Finished jobs are deleted this long after they end.
    #[arg(
        long,
        env = "TUNEQ_JOB_RETENTION",
        default_value = "7d",
        value_name = "DURATION"
    )]
    pub job_retention: Span,
    /// At most this many finished jobs are kept (the oldest go first).
    #[arg(long, env = "TUNEQ_JOB_RETENTION_COUNT", default_value_t = 100_000)]
    pub job_retention_count: u64,
    /// A dispatcher that stops renewing an attempt's lease for this long loses it, and the
    /// job goes back in line.
    #[arg(
        long,
        env = "TUNEQ_LEASE",
        default_value = "60s",
        value_name = "DURATION"
    )]
    pub lease: Span,
    /// Delay before a failed attempt is retried; it doubles with each failure.
    #[arg(
        long,
        env = "TUNEQ_RETRY_BASE",
        default_value = "10s",
        value_name = "DURATION"
    )]
    pub retry_base: Span,
    /// Longest delay before a retry.
    #[arg(
        long,
        env = "TUNEQ_RETRY_MAX",
        default_value = "10m",
        value_name = "DURATION"
    )]
    pub retry_max: Span,
    /// How long a waiting job takes to climb one priority level.
    #[arg(
        long,
        env = "TUNEQ_AGING",
        default_value = "2h",
        value_name = "DURATION"
    )]
    pub aging: Span,
}

impl QueueArgs {
    /// The queue's configuration: these settings over the queue's own defaults.
    pub fn queue_config(&self) -> Result<tuneq_queue::QueueConfig> {
        let positive = |name: &str, span: Span| {
            if span.0.is_zero() {
                Err(BadInput(format!("--{name} must be more than zero")))
            } else {
                Ok(span.millis())
            }
        };
        let retry_base_ms = positive("retry-base", self.retry_base)?;
        let retry_max_ms = positive("retry-max", self.retry_max)?;
        if retry_max_ms < retry_base_ms {
            return Err(BadInput(format!(
                "--retry-max ({}) is shorter than --retry-base ({})",
                humantime::format_duration(self.retry_max.0),
                humantime::format_duration(self.retry_base.0)
            ))
            .into());
        }
        Ok(tuneq_queue::QueueConfig {
            retention_ms: self.job_retention.millis(),
            retention_count: self.job_retention_count,
            lease_ms: positive("lease", self.lease)?,
            retry_base_ms,
            retry_max_ms,
            aging_horizon_ms: positive("aging", self.aging)?,
            ..tuneq_queue::QueueConfig::default()
        })
    }

    /// The Redis URL(s) with the password set on them, if a Redis is given.
    pub fn redis_url(&self) -> Result<Option<String>> {
        self.redis
            .as_ref()
            .map(|r| {
                super::service::queue::redis_with_password(
                    r.expose(),
                    self.redis_password.as_ref().map(Secret::expose),
                )
            })
            .transpose()
    }
}

/// Where the config file is: `--config FILE` or `TUNEQ_CONFIG`, found before the
/// command line is parsed for real (its values become the flags' defaults). Only the
/// services and `tuneq config` read one; other commands (a trainer started with the
/// dispatcher's environment among them) ignore it.
pub fn config_path(cmd: &clap::Command) -> Option<std::path::PathBuf> {
    let matches = cmd.clone().ignore_errors(true).try_get_matches().ok()?;
    let reads_config = matches
        .subcommand_name()
        .is_some_and(|name| SERVICES.contains(&name) || name == "config");
    if !reads_config {
        return None;
    }
    matches.get_one::<std::path::PathBuf>("config").cloned()
}

/// Reads the config file's tables, checking each service's keys against its flags, and
/// makes the values the defaults of those flags in `cmd` (the whole CLI). Returns the
/// command and, per service, the flag ids the file set.
pub fn apply_config_file(
    mut cmd: clap::Command,
    path: &Path,
) -> Result<(clap::Command, ConfigSources)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the config file {}", path.display()))?;
    let table: toml::Table = toml::from_str(&text)
        .map_err(|e| BadInput(format!("config file {}: {e}", path.display())))?;
    for key in table.keys() {
        if !SERVICES.contains(&key.as_str()) {
            return Err(BadInput(format!(
                "config file {}: unknown table [{key}] (expected one of [{}])",
                path.display(),
                SERVICES.join("], [")
            ))
            .into());
        }
    }
    let mut sources = ConfigSources::default();
    let mut holds_secret = false;
    for service in SERVICES {
        let Some(values) = table.get(service) else {
            continue;
        };
        let Some(values) = values.as_table() else {
            return Err(BadInput(format!(
                "config file {}: [{service}] must be a table",
                path.display()
            ))
            .into());
        };
        let mut set = Vec::new();
        let mut sub = cmd
            .find_subcommand(service)
            .cloned()
            .expect("every service is a subcommand");
        for (key, value) in values {
            let Some(arg) = sub
                .get_arguments()
                .find(|a| a.get_long() == Some(key.as_str()) && !is_builtin(a))
                .cloned()
            else {
                return Err(BadInput(format!(
                    "config file {}: [{service}] has no setting `{key}` (see `tuneq {service} --help`)",
                    path.display()
                ))
                .into());
            };
            let strings = toml_strings(value).map_err(|why| {
                BadInput(format!(
                    "config file {}: [{service}] {key}: {why}",
                    path.display()
                ))
            })?;
            // A URL without a password is no secret; anything else such a flag takes is.
            holds_secret |= arg.is_hide_env_values_set() && strings.iter().any(|v| mask(v) != *v);
            let id = arg.get_id().clone();
            set.push(id.to_string());
            sub = sub.mut_arg(id, |a| a.default_values(strings).required(false));
        }
        sources.set.push((service.to_string(), set));
        cmd = cmd.mut_subcommand(service, |_| sub);
        // `tuneq config show SERVICE` shows the same settings the service would use.
        let show_sub = cmd
            .find_subcommand("config")
            .and_then(|c| c.find_subcommand("show"))
            .and_then(|c| c.find_subcommand(service))
            .is_some();
        if show_sub {
            let service_cmd = cmd.find_subcommand(service).cloned().expect("just set");
            cmd = cmd.mut_subcommand("config", |c| {
                c.mut_subcommand("show", |s| {
                    s.mut_subcommand(service, |_| service_cmd.name(service))
                })
            });
        }
    }
    if holds_secret {
        check_private(path)?;
    }
    Ok((cmd, sources))
}

/// Flags every command has (`--help`, `--version`) and the global ones, which a config
/// file does not set.
fn is_builtin(arg: &clap::Arg) -> bool {
    arg.is_global_set() || matches!(arg.get_id().as_str(), "help" | "version")
}

/// A TOML value as flag values: scalars as one, arrays as many.
fn toml_strings(value: &toml::Value) -> Result<Vec<String>, String> {
    match value {
        toml::Value::String(s) => Ok(vec![s.clone()]),
        toml::Value::Integer(i) => Ok(vec![i.to_string()]),
        toml::Value::Float(f) => Ok(vec![f.to_string()]),
        toml::Value::Boolean(b) => Ok(vec![b.to_string()]),
        toml::Value::Array(items) => items
            .iter()
            .map(|v| match v {
                toml::Value::Array(_) | toml::Value::Table(_) => {
                    Err("nested arrays and tables are not settings".to_string())
                }
                scalar => toml_strings(scalar).map(|mut one| one.remove(0)),
            })
            .collect(),
        toml::Value::Datetime(d) => Ok(vec![d.to_string()]),
        toml::Value::Table(_) => Err("a table is not a setting".to_string()),
    }
}

/// Refuses a config file holding secrets that others may read.
fn check_private(path: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let mode = std::fs::metadata(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .mode();
    if mode & 0o077 != 0 {
        return Err(BadInput(format!(
            "config file {} holds secrets but others may read it (mode {:o}): `chmod 600` it, or give the secrets through the environment",
            path.display(),
            mode & 0o777
        ))
        .into());
    }
    Ok(())
}

/// Which flags, per service, took their value from the config file.
#[derive(Debug, Default)]
pub struct ConfigSources {
    set: Vec<(String, Vec<String>)>,
    /// The file they came from.
    pub path: Option<std::path::PathBuf>,
}

impl ConfigSources {
    fn set_by_file(&self, service: &str, id: &str) -> bool {
        self.set
            .iter()
            .any(|(s, ids)| s == service && ids.iter().any(|i| i == id))
    }
}

/// The effective settings of `service` as a TOML table a config file can hold, each
/// line saying where its value came from, secrets masked. `cmd` is the service's
/// subcommand as the CLI defines it (its flags' order is the order shown) and `matches`
/// its parsed arguments.
pub fn show(
    service: &str,
    cmd: &clap::Command,
    matches: &clap::ArgMatches,
    sources: &ConfigSources,
) -> String {
    use clap::parser::ValueSource;
    let mut out = format!(
        "# Effective settings of `tuneq {service}`: flags, then the environment, then {}, then defaults.\n# Secrets are masked.\n[{service}]\n",
        match &sources.path {
            Some(p) => format!("the config file {}", p.display()),
            None => "a config file (none given)".to_string(),
        }
    );
    for arg in cmd.get_arguments() {
        if is_builtin(arg) || arg.get_long().is_none() {
            continue;
        }
        let id = arg.get_id().as_str();
        let long = arg.get_long().unwrap_or(id);
        let values: Vec<String> = matches
            .get_raw(id)
            .map(|v| v.map(|s| s.to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let source = match matches.value_source(id) {
            Some(ValueSource::CommandLine) => "flag".to_string(),
            Some(ValueSource::EnvVariable) => format!(
                "env {}",
                arg.get_env()
                    .map_or_else(String::new, |e| e.to_string_lossy().into_owned())
            ),
            Some(ValueSource::DefaultValue) if sources.set_by_file(service, id) => {
                "config file".to_string()
            }
            Some(ValueSource::DefaultValue) => "default".to_string(),
            _ => "not set".to_string(),
        };
        if values.is_empty() {
            out.push_str(&format!("# {long} = (not set)\n"));
            continue;
        }
        let secret = arg.is_hide_env_values_set();
        let rendered: Vec<String> = values
            .iter()
            .map(|v| toml_value(&if secret { mask(v) } else { v.clone() }))
            .collect();
        let many = matches!(arg.get_action(), clap::ArgAction::Append);
        let value = if many {
            format!("[{}]", rendered.join(", "))
        } else {
            rendered.join(", ")
        };
        out.push_str(&format!("{long} = {value}  # {source}\n"));
    }
    out
}

/// A secret as shown: a URL keeps its scheme, host and path with the password masked;
/// anything else is masked whole.
fn mask(value: &str) -> String {
    let masked: Option<Vec<String>> = value
        .split(',')
        .map(|part| {
            let mut url = url::Url::parse(part.trim()).ok()?;
            if url.cannot_be_a_base() {
                return None;
            }
            if url.password().is_some() {
                url.set_password(Some(MASK)).ok()?;
            }
            Some(url.to_string())
        })
        .collect();
    masked.map_or_else(|| MASK.to_string(), |parts| parts.join(","))
}

/// A value as TOML: integers and booleans bare, anything else a quoted string.
fn toml_value(raw: &str) -> String {
    if raw.parse::<i64>().is_ok() || raw == "true" || raw == "false" {
        raw.to_string()
    } else {
        toml::Value::String(raw.to_string()).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let secret: Secret = "hunter2-hunter2".parse().expect("infallible");
        assert_eq!(format!("{secret} {secret:?}"), "******** ********");
        assert_eq!(secret.expose(), "hunter2-hunter2");
    }

    #[test]
    fn urls_keep_all_but_their_password() {
        assert_eq!(
            mask("redis://:pw@redis:6379/0,redis://u:pw@other:7000"),
            "redis://:********@redis:6379/0,redis://u:********@other:7000"
        );
        assert_eq!(mask("redis://redis:6379"), "redis://redis:6379");
        assert_eq!(mask("not a url"), MASK);
    }

    #[test]
    fn retry_settings_are_checked() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            queue: QueueArgs,
        }
        let flags = Flags::parse_from(["x", "--retry-base", "1m", "--retry-max", "30s"]);
        let err = flags
            .queue
            .queue_config()
            .expect_err("retry-max below retry-base")
            .to_string();
        assert!(err.contains("--retry-max (30s) is shorter"), "{err}");
        let flags = Flags::parse_from(["x", "--job-retention", "14d", "--lease", "90s"]);
        let config = flags.queue.queue_config().expect("valid settings");
        assert_eq!(config.retention_ms, 14 * 24 * 3600 * 1000);
        assert_eq!(config.lease_ms, 90_000);
        assert_eq!(config.retry_base_ms, 10_000);
    }
}
