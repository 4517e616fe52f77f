//! The API client, built the way upstream kube-proxy builds it: from a kubeconfig file when
//! one is given, else from `--master` alone (with the default kubeconfig loading rules if they
//! find one), else from the in-cluster service account.
//!
//! It also says how this process authenticates ([`ClientIdentity`]: kubeconfig, server,
//! token file, CA), so that an authentication or authorisation failure ([`ApiFailure`]) is
//! logged as an error naming them from the first one, instead of as one more retried
//! request: a wrong token never fixes itself.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use kube::config::{KubeConfigOptions, Kubeconfig};

/// Where the in-cluster service account's token and CA are mounted.
const IN_CLUSTER_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
const IN_CLUSTER_CA: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";

/// How the client reaches and authenticates to the API server, for messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    /// `kubeconfig /path`, `in-cluster service account` or `--master URL`.
    pub source: String,
    pub server: String,
    pub token_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
}

impl fmt::Display for ClientIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (server {}", self.source, self.server)?;
        if let Some(token) = &self.token_file {
            write!(f, ", token file {}", token.display())?;
        }
        if let Some(ca) = &self.ca_file {
            write!(f, ", CA {}", ca.display())?;
        }
        f.write_str(")")
    }
}

static IDENTITY: RwLock<Option<ClientIdentity>> = RwLock::new(None);

/// The identity of the client built last (what failures are reported against).
pub fn current_identity() -> Option<ClientIdentity> {
    IDENTITY.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
}

fn set_identity(identity: ClientIdentity) {
    *IDENTITY.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(identity);
}

/// A failure that retrying the same request will not cure: the credentials or the trust.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiFailure {
    /// 401: the token (or certificate) is not accepted.
    Unauthorized(String),
    /// 403: the identity lacks a permission (RBAC).
    Forbidden(String),
    /// The server's certificate is not trusted with the configured CA (or the TLS setup
    /// failed otherwise).
    Tls(String),
}

impl ApiFailure {
    /// What to check, for the log line.
    pub fn hint(&self) -> &'static str {
        match self {
            ApiFailure::Unauthorized(_) => {
                "the API server rejected the credentials: check the token file (a service account token, \
                 projected by the kubelet) and that the kubeconfig names the right cluster"
            }
            ApiFailure::Forbidden(_) => {
                "the API server denied access: the service account needs the system:node-proxier \
                 ClusterRole (kubeadm binds it as kubeadm:node-proxier) or deploy/kube-proxy-rs.yaml's ClusterRole"
            }
            ApiFailure::Tls(_) => {
                "TLS to the API server failed: check the CA file and the server address in the kubeconfig"
            }
        }
    }
}

impl fmt::Display for ApiFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiFailure::Unauthorized(m) => write!(f, "401 Unauthorized: {m}"),
            ApiFailure::Forbidden(m) => write!(f, "403 Forbidden: {m}"),
            ApiFailure::Tls(m) => write!(f, "TLS: {m}"),
        }
    }
}

/// Whether `err` is an authentication, authorisation or TLS trust failure.
pub fn classify(err: &kube::Error) -> Option<ApiFailure> {
    match err {
        kube::Error::Api(status) if status.code == 401 => Some(ApiFailure::Unauthorized(status.message.clone())),
        kube::Error::Api(status) if status.code == 403 => Some(ApiFailure::Forbidden(status.message.clone())),
        kube::Error::Api(_) => None,
        other => {
            // The TLS layer's errors arrive wrapped (hyper, tower); look at the whole chain.
            let mut text = other.to_string();
            let mut source = std::error::Error::source(other);
            while let Some(e) = source {
                text.push_str(": ");
                text.push_str(&e.to_string());
                source = e.source();
            }
            let lower = text.to_ascii_lowercase();
            let tls = ["certificate", "unknownissuer", "invalidcertificate", "tls handshake", "badsignature"];
            tls.iter().any(|needle| lower.contains(needle)).then_some(ApiFailure::Tls(text))
        }
    }
}

/// Logs `err` from `what` (e.g. `list Services`): an [`ApiFailure`] as an error naming the
/// client's identity, anything else at `warn`. Returns whether it was such a failure.
pub fn log_request_failure(what: &str, err: &kube::Error) -> bool {
    match classify(err) {
        Some(failure) => {
            let identity = current_identity().map_or_else(|| "unknown client".to_string(), |i| i.to_string());
            tracing::error!(request = what, client = %identity, error = %failure, hint = failure.hint(), "API server request failed");
            true
        }
        None => {
            tracing::warn!(request = what, error = %err, "API server request failed; retrying");
            false
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--master {url}: {source}")]
    MasterUrl {
        url: String,
        #[source]
        source: hyper::http::uri::InvalidUri,
    },
    #[error("kubeconfig {}: {source}", .path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("in-cluster configuration: {0}")]
    InCluster(#[source] kube::config::InClusterError),
    #[error("client setup: {0}")]
    Client(#[source] kube::Error),
}

/// Builds the client from `kubeconfig` (wins), else `master`, else the in-cluster config;
/// `master` also overrides the kubeconfig's server, as upstream's `--master` does.
pub async fn build(kubeconfig: Option<&Path>, master: Option<&str>) -> Result<kube::Client, ClientError> {
    let config = config(kubeconfig, master).await?;
    set_identity(identity(kubeconfig, master, &config));
    kube::Client::try_from(config).map_err(ClientError::Client)
}

/// How `config` (built from these arguments) authenticates, for messages.
pub fn identity(kubeconfig: Option<&Path>, master: Option<&str>, config: &kube::Config) -> ClientIdentity {
    let server = config.cluster_url.to_string();
    match kubeconfig {
        Some(path) => {
            let (token_file, ca_file) = kubeconfig_files(path);
            ClientIdentity { source: format!("kubeconfig {}", path.display()), server, token_file, ca_file }
        }
        None if master.is_none() => ClientIdentity {
            source: "in-cluster service account".into(),
            server,
            token_file: Some(IN_CLUSTER_TOKEN.into()),
            ca_file: Some(IN_CLUSTER_CA.into()),
        },
        None => ClientIdentity {
            source: format!("--master {}", master.unwrap_or_default()),
            server,
            token_file: None,
            ca_file: None,
        },
    }
}

/// The token file and CA file the current context of the kubeconfig at `path` names.
fn kubeconfig_files(path: &Path) -> (Option<PathBuf>, Option<PathBuf>) {
    let Ok(kc) = Kubeconfig::read_from(path) else {
        return (None, None);
    };
    let context = kc
        .current_context
        .as_deref()
        .and_then(|name| kc.contexts.iter().find(|c| c.name == name))
        .and_then(|c| c.context.as_ref());
    let user = context.map(|c| c.user.clone()).unwrap_or_default();
    let cluster = context.map(|c| c.cluster.clone()).unwrap_or_default();
    let token = kc
        .auth_infos
        .iter()
        .find(|a| Some(a.name.as_str()) == user.as_deref())
        .and_then(|a| a.auth_info.as_ref())
        .and_then(|a| a.token_file.clone())
        .map(PathBuf::from);
    let ca = kc
        .clusters
        .iter()
        .find(|c| c.name == cluster)
        .and_then(|c| c.cluster.as_ref())
        .and_then(|c| c.certificate_authority.clone())
        .map(PathBuf::from);
    (token, ca)
}

/// The client configuration [`build`] uses.
pub async fn config(kubeconfig: Option<&Path>, master: Option<&str>) -> Result<kube::Config, ClientError> {
    let master_url = match master {
        Some(m) => {
            Some(m.parse::<hyper::Uri>().map_err(|source| ClientError::MasterUrl { url: m.to_string(), source })?)
        }
        None => None,
    };
    let kubeconfig_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ClientError::Kubeconfig { path, source }
    };
    let mut config = match (kubeconfig, &master_url) {
        (Some(path), _) => {
            let kc = Kubeconfig::read_from(path).map_err(kubeconfig_err(path))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(kubeconfig_err(path))?
        }
        (None, None) => {
            tracing::info!("neither kubeconfig file nor master URL was specified, falling back to in-cluster config");
            kube::Config::incluster().map_err(ClientError::InCluster)?
        }
        (None, Some(url)) => match kube::Config::infer().await {
            Ok(c) => c,
            Err(_) => kube::Config::new(url.clone()),
        },
    };
    if let Some(url) = master_url {
        config.cluster_url = url;
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn errors_name_what_was_wrong() {
        let err = config(None, Some("http://[::1")).await.unwrap_err();
        assert!(err.to_string().starts_with("--master http://[::1: "), "{err}");

        let missing = Path::new("/nonexistent/kubeconfig");
        let err = config(Some(missing), None).await.unwrap_err();
        assert!(err.to_string().starts_with("kubeconfig /nonexistent/kubeconfig: "), "{err}");
    }

    #[tokio::test]
    async fn master_overrides_the_kubeconfig_server() {
        let dir = std::env::temp_dir().join(format!("kpr-client-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://198.18.0.1:6443\n\
             contexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n\
             users:\n- name: u\n  user: {}\n",
        )
        .unwrap();
        let from_file = config(Some(&path), None).await.unwrap();
        let overridden = config(Some(&path), Some("http://198.18.0.2:8080")).await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(from_file.cluster_url.to_string(), "http://198.18.0.1:6443/");
        assert_eq!(overridden.cluster_url.to_string(), "http://198.18.0.2:8080/");
    }
}
