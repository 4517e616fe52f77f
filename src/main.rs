//! Entry point: parse flags, set up logging, dispatch, map errors to exit codes.

use std::process::ExitCode;

use clap::Parser;
use kube_proxy_rs::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match cli.command {
        Some(Command::Render(args)) => {
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::with_capacity(1 << 20, stdout.lock());
            match kube_proxy_rs::render_cmd::run(&args, &mut out) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    drop(out);
                    eprintln!("kube-proxy-rs render: {e}");
                    ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(1))
                }
            }
        }
        None if cli.daemon.cleanup => {
            if kube_proxy_rs::app::cleanup() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        None => {
            eprintln!("kube-proxy-rs: the daemon mode is not implemented yet; see `kube-proxy-rs render --help`");
            ExitCode::from(2)
        }
    }
}

/// Logs go to stderr; `RUST_LOG` adjusts the level (default: warnings and errors).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(ansi)
        .init();
}
