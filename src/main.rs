//! Entry point: parse flags, set up logging, dispatch, map errors to exit codes.
//!
//! Exit codes: 0 on success; 2 for flags that do not parse (one line naming the flag) and,
//! for now, for the daemon itself (not implemented yet); 1 for a configuration that parses but
//! is invalid or unreadable, as upstream kube-proxy (one line per invalid field); `render` keeps
//! its own codes.

use std::process::ExitCode;

use clap::error::{ContextKind, ErrorKind};
use kube_proxy_rs::cmd::cli::{Cli, Command, DaemonArgs};
use kube_proxy_rs::cmd::options;
use kube_proxy_rs::config::{KubeProxyConfiguration, LoggingConfig};
use kube_proxy_rs::daemon::app::Stopped;

fn main() -> ExitCode {
    let cli = match parse_args() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    match cli.command {
        Some(Command::Render(args)) => {
            init_logging(None);
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::with_capacity(1 << 20, stdout.lock());
            match kube_proxy_rs::cmd::render::run(&args, &mut out) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    drop(out);
                    eprintln!("kube-proxy-rs render: {e}");
                    ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(1))
                }
            }
        }
        Some(Command::Trace(args)) => {
            init_logging(None);
            let stdout = std::io::stdout();
            let mut out = stdout.lock();
            match kube_proxy_rs::cmd::trace::run(&args, &kube_proxy_rs::cmd::trace::RealNode, &mut out) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("kube-proxy-rs trace: {e}");
                    ExitCode::from(e.exit_code())
                }
            }
        }
        Some(Command::Diff(args)) => {
            init_logging(None);
            let stdout = std::io::stdout();
            let mut out = stdout.lock();
            match kube_proxy_rs::cmd::diff::run(&args, &kube_proxy_rs::cmd::trace::RealNode, &mut out) {
                Ok(false) => ExitCode::SUCCESS,
                Ok(true) => ExitCode::from(1),
                Err(e) => {
                    eprintln!("kube-proxy-rs diff: {e}");
                    ExitCode::from(e.exit_code())
                }
            }
        }
        None => daemon(&cli.daemon),
    }
}

/// The command line, with the help naming the program as it was run: `kube-proxy` from
/// upstream's path in our image (kubeadm's DaemonSet runs `/usr/local/bin/kube-proxy`), else
/// `kube-proxy-rs`. The name changes nothing else.
fn parse_args() -> Result<Cli, clap::Error> {
    use clap::{CommandFactory, FromArgMatches};
    let invoked = std::env::args_os()
        .next()
        .and_then(|arg0| std::path::Path::new(&arg0).file_name().map(|n| n.to_string_lossy().into_owned()));
    let mut command = Cli::command();
    if invoked.as_deref() == Some("kube-proxy") {
        command = command.bin_name("kube-proxy");
    }
    let matches = command.try_get_matches()?;
    Cli::from_arg_matches(&matches)
}

/// Prints a flag parsing error as one line (help and version go through clap as usual).
fn usage_error(e: &clap::Error) -> ExitCode {
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    // A stray word is taken for a subcommand; say what it usually is instead (`--flag false`).
    if let Some(word) = e.get(ContextKind::InvalidSubcommand) {
        eprintln!(
            "kube-proxy-rs: unexpected argument '{word}': the daemon takes no positional arguments \
             (give a boolean flag's value as --flag=false; the subcommands are `render`, `trace` and `diff`)"
        );
        return ExitCode::from(2);
    }
    let text = e.render().to_string();
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("invalid arguments");
    eprintln!("kube-proxy-rs: {} (see --help)", first.strip_prefix("error: ").unwrap_or(first));
    ExitCode::from(2)
}

/// The daemon's command line: resolve the configuration (always, as upstream validates before
/// doing anything), then `--write-config-to`, `--cleanup`, or the daemon.
fn daemon(args: &DaemonArgs) -> ExitCode {
    let (cfg, lenient) = match options::effective_config_reporting(args) {
        Ok(resolved) => resolved,
        Err(e) => {
            for line in e.to_string().lines() {
                eprintln!("kube-proxy-rs: {line}");
            }
            return ExitCode::from(1);
        }
    };
    init_logging(Some(&cfg.logging));
    if let Some(lenient) = &lenient {
        lenient.log();
    }
    let ignored = options::ignored_flags(args);
    if !ignored.is_empty() {
        let flags: Vec<String> = ignored.iter().map(|f| format!("--{f}")).collect();
        tracing::warn!(
            flags = %flags.join(" "),
            "these flags are ignored because --config is given (as upstream does); set the fields in the file"
        );
    }

    if let Some(path) = &args.write_config_to {
        return write_config(&cfg, path);
    }
    if args.cleanup {
        if let Err(e) = kube_proxy_rs::node::capabilities::check_this_process() {
            eprintln!("kube-proxy-rs: {e}");
            return ExitCode::from(1);
        }
        return if kube_proxy_rs::daemon::app::cleanup() { ExitCode::SUCCESS } else { ExitCode::from(1) };
    }
    match kube_proxy_rs::daemon::app::run_daemon(&cfg, args.config.as_deref(), args.master.as_deref(), args.init_only) {
        Ok(Stopped::Signal | Stopped::Initialized) => ExitCode::SUCCESS,
        // Expected: exit non-zero (as upstream) so the DaemonSet starts it again, but say so
        // as what it is, not as a failure.
        Ok(Stopped::Restart(reason)) => {
            tracing::info!(reason = %reason, "exiting to be restarted");
            eprintln!("kube-proxy-rs: {reason}");
            ExitCode::from(1)
        }
        Err(e) => {
            tracing::error!(error = %e, "kube-proxy-rs stopped");
            eprintln!("kube-proxy-rs: {e}");
            ExitCode::from(1)
        }
    }
}

fn write_config(cfg: &KubeProxyConfiguration, path: &std::path::Path) -> ExitCode {
    match options::write_config(cfg, path) {
        Ok(changed) => {
            if !changed.is_empty() {
                tracing::warn!(
                    fields = %changed.join(", "),
                    "these zero values will read back as their defaults when the file is used with --config"
                );
            }
            tracing::info!(file = %path.display(), "Wrote configuration");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kube-proxy-rs: {e}");
            ExitCode::from(1)
        }
    }
}

/// Logs go to stderr. `RUST_LOG` sets the filter when present; otherwise the daemon's level
/// follows `-v` (0-1 info, 2-4 debug, 5+ trace) and `render` logs warnings and errors.
/// `--logging-format=json` writes JSON lines.
fn init_logging(logging: Option<&LoggingConfig>) {
    // -v applies to this program's own logs; libraries (the API client, HTTP) stay at warn
    // until -v 6 and above, where upstream logs its client's requests too.
    let default_level = match logging.map(|l| l.verbosity) {
        None => "warn".to_string(),
        Some(0..=1) => "warn,kube_proxy_rs=info".to_string(),
        Some(2..=4) => "warn,kube_proxy_rs=debug".to_string(),
        Some(5) => "warn,kube_proxy_rs=trace".to_string(),
        Some(_) => "debug,kube_proxy_rs=trace".to_string(),
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&default_level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false);
    if logging.is_some_and(|l| l.format == "json") {
        builder.json().init();
    } else {
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        builder.with_ansi(ansi).init();
    }
}
