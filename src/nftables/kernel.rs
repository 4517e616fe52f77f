//! The kernel check upstream makes before nftables mode (pkg/proxy/nftables/supported.go,
//! `getNFTablesInterface`): the kernel must be 5.13 or later (taken to imply an nft ≥ 1.0.1
//! on the host, issue 122743), unless `KUBE_PROXY_NFTABLES_SKIP_KERNEL_VERSION_CHECK` is set
//! to anything non-empty. Upstream runs it after the `nft` checks ([`super::NftRunner::new`]).
//!
//! Up to 1.32 upstream's condition was inverted (`!= ""`): the check ran only when the
//! variable was set, so by default any kernel passed; [`KernelCheck::InvertedUpTo1_32`]
//! reproduces that, [`KernelCheck::Fixed`] is the later behaviour.

/// The variable that skips the check.
pub const SKIP_KERNEL_CHECK_ENV: &str = "KUBE_PROXY_NFTABLES_SKIP_KERNEL_VERSION_CHECK";

/// The oldest kernel upstream accepts for nftables mode (`NFTablesKubeProxyKernelVersion`).
pub const MINIMUM_KERNEL: (u32, u32) = (5, 13);

/// Which of upstream's two conditions applies (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelCheck {
    /// 1.31 and 1.32: checked only when the variable is set.
    InvertedUpTo1_32,
    /// From 1.33/1.34: checked unless the variable is set.
    Fixed,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelCheckError {
    #[error("could not check kernel version: {0}")]
    Unreadable(String),
    #[error("kube-proxy in nftables mode requires kernel 5.13 or later")]
    TooOld,
}

/// `major.minor` of a kernel release string such as `6.18.44-fc-v657` (upstream's
/// `version.ParseGeneric` on `/proc/sys/kernel/osrelease`).
pub fn parse_release(release: &str) -> Option<(u32, u32)> {
    let release = release.trim();
    let release = release.strip_prefix('v').unwrap_or(release);
    let numeric: String = release.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    let mut parts = numeric.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Upstream's check. `release` is the kernel release (the contents of
/// `/proc/sys/kernel/osrelease`, or the error reading it); `skip_env` the variable's value.
pub fn check_kernel(
    release: Result<&str, String>,
    skip_env: Option<&str>,
    check: KernelCheck,
) -> Result<(), KernelCheckError> {
    let set = skip_env.is_some_and(|v| !v.is_empty());
    let runs = match check {
        KernelCheck::Fixed => !set,
        KernelCheck::InvertedUpTo1_32 => set,
    };
    if !runs {
        return Ok(());
    }
    let release = release.map_err(KernelCheckError::Unreadable)?;
    let version = parse_release(release)
        .ok_or_else(|| KernelCheckError::Unreadable(format!("could not parse {:?}", release.trim())))?;
    if version < MINIMUM_KERNEL {
        return Err(KernelCheckError::TooOld);
    }
    Ok(())
}

/// [`check_kernel`] on this host: reads `/proc/sys/kernel/osrelease` and the variable.
pub fn check_host_kernel(check: KernelCheck) -> Result<(), KernelCheckError> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").map_err(|e| e.to_string());
    let skip = std::env::var(SKIP_KERNEL_CHECK_ENV).ok();
    check_kernel(release.as_deref().map_err(Clone::clone), skip.as_deref(), check)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_are_read_like_parse_generic() {
        assert_eq!(parse_release("6.18.44-fc-v657\n"), Some((6, 18)));
        assert_eq!(parse_release("5.13.0-1-amd64"), Some((5, 13)));
        assert_eq!(parse_release("4.19"), Some((4, 19)));
        assert_eq!(parse_release("garbage"), None);
    }

    #[test]
    fn the_check_and_its_override() {
        use KernelCheck::*;
        assert_eq!(check_kernel(Ok("5.12.9"), None, Fixed), Err(KernelCheckError::TooOld));
        assert_eq!(check_kernel(Ok("5.13.0"), None, Fixed), Ok(()));
        assert_eq!(check_kernel(Ok("6.1.0"), Some(""), Fixed), Ok(()));
        assert_eq!(check_kernel(Ok("4.19.0"), Some("1"), Fixed), Ok(()), "the variable skips it");
        assert_eq!(check_kernel(Ok("4.19.0"), Some(""), Fixed), Err(KernelCheckError::TooOld), "empty is unset");
        assert!(matches!(check_kernel(Err("denied".into()), None, Fixed), Err(KernelCheckError::Unreadable(_))));
        // Up to 1.32 the condition was inverted.
        assert_eq!(check_kernel(Ok("4.19.0"), None, InvertedUpTo1_32), Ok(()));
        assert_eq!(check_kernel(Ok("4.19.0"), Some("1"), InvertedUpTo1_32), Err(KernelCheckError::TooOld));
    }
}
