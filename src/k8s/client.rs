//! The API client, built the way upstream kube-proxy builds it: from a kubeconfig file when
//! one is given, else from `--master` alone (with the default kubeconfig loading rules if they
//! find one), else from the in-cluster service account.

use std::path::{Path, PathBuf};

use kube::config::{KubeConfigOptions, Kubeconfig};

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
    kube::Client::try_from(config(kubeconfig, master).await?).map_err(ClientError::Client)
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
