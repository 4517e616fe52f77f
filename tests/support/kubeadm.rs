//! kubeadm's kube-proxy addon, as kubeadm 1.35–1.37 writes it (cmd/kubeadm/app/phases/addons/
//! proxy/manifests.go and componentconfigs/kubeproxy.go; docs/operations.md quotes it): the
//! `kube-proxy` ConfigMap's `config.conf` and `kubeconfig.conf`, mounted at
//! /var/lib/kube-proxy, and the container's command line. kubeadm marshals an almost empty
//! KubeProxyConfiguration (bindAddress, clusterCIDR from podSubnet, the kubeconfig path; from
//! 1.37 `mode: iptables`) with every other field at its zero value, which kube-proxy defaults.

/// Where the ConfigMap is mounted.
pub const CONFIG_DIR: &str = "/var/lib/kube-proxy";
/// The pod's service-account files (token and CA), as the kubelet projects them.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The binary kubeadm's DaemonSet runs.
pub const COMMAND: &str = "/usr/local/bin/kube-proxy";

/// The container's command line after the kubelet expanded `$(NODE_NAME)`.
pub fn command(node_name: &str) -> Vec<String> {
    vec![COMMAND.into(), format!("--config={CONFIG_DIR}/config.conf"), format!("--hostname-override={node_name}")]
}

/// `config.conf` as kubeadm of `release` (35, 36 or 37) writes it for `pod_subnet`.
pub fn config_conf(release: u8, pod_subnet: &str) -> String {
    let mode = if release >= 37 { "iptables" } else { "\"\"" };
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: {pod_subnet}
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: {mode}
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#
    )
}

/// `kubeconfig.conf`: the API server's address, the service account's CA and token file.
pub fn kubeconfig_conf(server: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority: {SERVICE_ACCOUNT_DIR}/ca.crt
    server: {server}
  name: default
contexts:
- context:
    cluster: default
    namespace: default
    user: default
  name: default
current-context: default
users:
- name: default
  user:
    tokenFile: {SERVICE_ACCOUNT_DIR}/token
"#
    )
}
