//! Build script: records the git commit the binary is built from, for `--version` and the
//! image's labels. `KPRS_GIT_COMMIT` overrides it (a container build without `.git`); without
//! either it is "unknown" (a source tarball), never a build failure.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

fn main() {
    println!("cargo:rerun-if-env-changed=KPRS_GIT_COMMIT");
    let commit = match std::env::var("KPRS_GIT_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => {
            watch_git_head();
            git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into())
        }
    };
    println!("cargo:rustc-env=KPRS_GIT_COMMIT={commit}");
}

/// Reruns the script when HEAD moves: HEAD itself (a checkout) and the branch it points to (a
/// commit), in this worktree's git dir or the common one. Only existing files are named: cargo
/// reruns a script every build for a path that does not exist.
fn watch_git_head() {
    let (Some(git_dir), Some(common)) = (git(&["rev-parse", "--git-dir"]), git(&["rev-parse", "--git-common-dir"]))
    else {
        return;
    };
    let (git_dir, common) = (PathBuf::from(git_dir), PathBuf::from(common));
    let head = git_dir.join("HEAD");
    let mut watch = vec![head.clone(), common.join("packed-refs")];
    if let Some(branch) =
        std::fs::read_to_string(&head).ok().and_then(|h| h.strip_prefix("ref: ").map(|r| r.trim().to_string()))
    {
        watch.push(git_dir.join(&branch));
        watch.push(common.join(&branch));
    }
    for path in watch.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}
