//! deploy/: every manifest document deserializes into the k8s-openapi type of its kind with no
//! field that type does not know (serde would otherwise drop a misspelt field silently), and
//! the properties the node needs hold: host network, the xtables lock and /lib/modules mounts,
//! tolerate-everything, the /livez probe on the health port, exactly the least-privilege RBAC,
//! a ConfigMap whose config.conf validates, and container command lines our own flag parser
//! accepts. Privileges: only the `--init-only` init container is privileged; the daemon and
//! the cleanup Job drop every capability but exactly the ones the daemon checks for
//! ([`kube_proxy_rs::node::capabilities::REQUIRED`], proven by tests/e2e_privileges.rs), on a
//! read-only root filesystem. The nftables-mode DaemonSet (kube-proxy-rs-nftables.yaml) passes
//! the same checks with nftables mode's capability
//! ([`kube_proxy_rs::node::capabilities::REQUIRED_NFTABLES`]) and differs from the iptables one
//! in nothing but its mode section and that capability.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::Parser;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, SecurityContext, ServiceAccount, Toleration, Volume};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use kube_proxy_rs::cmd::cli::Cli;
use kube_proxy_rs::cmd::options;
use kube_proxy_rs::config;
use kube_proxy_rs::node::capabilities::{REQUIRED, REQUIRED_NFTABLES, Requirement};

const NAMESPACE: &str = "kube-system";
const NAME: &str = "kube-proxy-rs";
/// The image scripts/image.sh names (docs/operations.md, "The image").
const IMAGE: &str = concat!("kube-proxy-rs:", env!("CARGO_PKG_VERSION"));

/// One typed manifest document.
#[derive(Debug)]
enum Object {
    ServiceAccount(Box<ServiceAccount>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    ConfigMap(Box<ConfigMap>),
    DaemonSet(Box<DaemonSet>),
    Job(Box<Job>),
}

impl Object {
    fn kind(&self) -> &'static str {
        match self {
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
            Object::ConfigMap(_) => "ConfigMap",
            Object::DaemonSet(_) => "DaemonSet",
            Object::Job(_) => "Job",
        }
    }
}

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// Deserializes `value` as `T` and checks that serializing it back keeps every key.
#[track_caller]
fn typed<T: DeserializeOwned + serde::Serialize>(value: serde_yaml::Value, what: &str) -> T {
    let object: T = serde_yaml::from_value(value.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let original = serde_json::to_value(&value).expect("yaml → json");
    let reserialized = serde_json::to_value(&object).expect("typed → json");
    let mut unknown = Vec::new();
    unknown_keys("", &original, &reserialized, &mut unknown);
    assert!(unknown.is_empty(), "{what}: fields its type does not know: {unknown:?}");
    object
}

/// Paths of object keys present in `original` but missing from `typed`.
fn unknown_keys(path: &str, original: &serde_json::Value, typed: &serde_json::Value, out: &mut Vec<String>) {
    match (original, typed) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (key, value) in a {
                let child = format!("{path}.{key}");
                match b.get(key) {
                    Some(other) => unknown_keys(&child, value, other, out),
                    None if value.is_null() => {}
                    None => out.push(child),
                }
            }
        }
        (serde_json::Value::Array(a), serde_json::Value::Array(b)) => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                unknown_keys(&format!("{path}[{i}]"), x, y, out);
            }
        }
        _ => {}
    }
}

/// Every document of one manifest file, typed by its kind.
fn load(file: &str) -> Vec<Object> {
    let path = deploy_dir().join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut objects = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let value = serde_yaml::Value::deserialize(doc).unwrap_or_else(|e| panic!("{file} document {i}: {e}"));
        if value.is_null() {
            continue;
        }
        let kind = value.get("kind").and_then(serde_yaml::Value::as_str).unwrap_or_default().to_string();
        let what = format!("{file} document {i} ({kind})");
        let object = match kind.as_str() {
            "ServiceAccount" => Object::ServiceAccount(Box::new(typed(value, &what))),
            "ClusterRole" => Object::ClusterRole(Box::new(typed(value, &what))),
            "ClusterRoleBinding" => Object::ClusterRoleBinding(Box::new(typed(value, &what))),
            "ConfigMap" => Object::ConfigMap(Box::new(typed(value, &what))),
            "DaemonSet" => Object::DaemonSet(Box::new(typed(value, &what))),
            "Job" => Object::Job(Box::new(typed(value, &what))),
            other => panic!("{what}: unexpected kind {other:?}"),
        };
        objects.push(object);
    }
    objects
}

struct Stack {
    service_account: ServiceAccount,
    role: ClusterRole,
    binding: ClusterRoleBinding,
    config_map: ConfigMap,
    daemon_set: DaemonSet,
}

/// The two DaemonSet manifests: file, the mode its config.conf sets, the capabilities its
/// daemon container must add.
const DAEMON_SETS: [(&str, &str, &[Requirement]); 2] =
    [("kube-proxy-rs.yaml", "iptables", REQUIRED), ("kube-proxy-rs-nftables.yaml", "nftables", REQUIRED_NFTABLES)];

fn stack(file: &str) -> Stack {
    let objects = load(file);
    let kinds: Vec<&str> = objects.iter().map(Object::kind).collect();
    assert_eq!(kinds, ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"]);
    let (mut sa, mut role, mut binding, mut cm, mut ds) = (None, None, None, None, None);
    for object in objects {
        match object {
            Object::ServiceAccount(o) => sa = Some(*o),
            Object::ClusterRole(o) => role = Some(*o),
            Object::ClusterRoleBinding(o) => binding = Some(*o),
            Object::ConfigMap(o) => cm = Some(*o),
            Object::DaemonSet(o) => ds = Some(*o),
            Object::Job(_) => unreachable!("checked above"),
        }
    }
    Stack {
        service_account: sa.expect("ServiceAccount"),
        role: role.expect("ClusterRole"),
        binding: binding.expect("ClusterRoleBinding"),
        config_map: cm.expect("ConfigMap"),
        daemon_set: ds.expect("DaemonSet"),
    }
}

fn cleanup_job() -> Job {
    let mut objects = load("cleanup-job.yaml");
    assert_eq!(objects.len(), 1, "one Job");
    match objects.pop() {
        Some(Object::Job(job)) => *job,
        other => panic!("expected a Job, got {other:?}"),
    }
}

#[test]
fn every_manifest_in_deploy_parses() {
    let mut files: Vec<String> = std::fs::read_dir(deploy_dir())
        .expect("deploy/")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .collect();
    files.sort();
    assert_eq!(
        files,
        ["cleanup-job.yaml", "kube-proxy-rs-nftables.yaml", "kube-proxy-rs.yaml"],
        "a new manifest needs checks here"
    );
    for file in &files {
        assert!(!load(file).is_empty(), "{file}");
    }
}

fn only_container(spec: &PodSpec) -> &Container {
    assert_eq!(spec.containers.len(), 1, "one container");
    &spec.containers[0]
}

fn volume<'a>(spec: &'a PodSpec, name: &str) -> &'a Volume {
    spec.volumes.iter().flatten().find(|v| v.name == name).unwrap_or_else(|| panic!("volume {name} missing"))
}

/// The mount at `path` of the pod's only container: (volume, read-only).
fn mount<'a>(spec: &'a PodSpec, path: &str) -> (&'a Volume, bool) {
    mount_of(spec, only_container(spec), path)
}

/// The mount at `path` of container `c`: (volume, read-only).
fn mount_of<'a>(spec: &'a PodSpec, c: &Container, path: &str) -> (&'a Volume, bool) {
    let m = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == path)
        .unwrap_or_else(|| panic!("nothing mounted at {path}"));
    (volume(spec, &m.name), m.read_only == Some(true))
}

/// hostNetwork, the xtables lock (read-write, FileOrCreate), /lib/modules (read-only),
/// tolerate everything, system-node-critical, no host path beyond those two, and a container
/// with only `required`'s capabilities: what both the daemon and the cleanup pod need.
#[track_caller]
fn assert_node_level_pod(spec: &PodSpec, required: &[Requirement]) {
    assert_eq!(spec.host_network, Some(true), "hostNetwork");
    assert_eq!((spec.host_pid, spec.host_ipc), (None, None), "no host PID or IPC namespace");
    assert_eq!(spec.priority_class_name.as_deref(), Some("system-node-critical"));
    let tolerate_all = Toleration { operator: Some("Exists".into()), ..Default::default() };
    assert_eq!(spec.tolerations.as_deref(), Some(&[tolerate_all][..]), "tolerates every taint");
    assert!(spec.security_context.is_none(), "no pod-level securityContext to override the containers'");
    let c = only_container(spec);
    assert_eq!(c.image.as_deref(), Some(IMAGE));
    assert_least_privilege(c, required);
    assert_host_mounts(spec, c);
    let host_paths: BTreeSet<&str> =
        spec.volumes.iter().flatten().filter_map(|v| v.host_path.as_ref()).map(|h| h.path.as_str()).collect();
    assert_eq!(host_paths, BTreeSet::from(["/lib/modules", "/run/xtables.lock"]), "no other host path");
}

/// The xtables lock (read-write hostPath, FileOrCreate) and /lib/modules (read-only) mounted
/// into `c`, and every mount of `c` names a volume that exists.
#[track_caller]
fn assert_host_mounts(spec: &PodSpec, c: &Container) {
    let (lock, read_only) = mount_of(spec, c, "/run/xtables.lock");
    assert!(!read_only, "the xtables lock must be writable");
    let host = lock.host_path.as_ref().expect("xtables lock is a hostPath");
    assert_eq!((host.path.as_str(), host.type_.as_deref()), ("/run/xtables.lock", Some("FileOrCreate")));
    let (modules, read_only) = mount_of(spec, c, "/lib/modules");
    assert!(read_only, "/lib/modules is mounted read-only");
    assert_eq!(modules.host_path.as_ref().map(|h| h.path.as_str()), Some("/lib/modules"));
    for m in c.volume_mounts.iter().flatten() {
        volume(spec, &m.name);
    }
}

/// Not privileged, no privilege escalation, a read-only root filesystem, root's uid (the
/// iptables children get the capabilities only that way), and every capability dropped but
/// exactly the ones the daemon checks for at start-up (`required`).
#[track_caller]
fn assert_least_privilege(c: &Container, required: &[Requirement]) {
    let sc = c.security_context.as_ref().unwrap_or_else(|| panic!("{}: securityContext", c.name));
    let SecurityContext {
        privileged,
        allow_privilege_escalation,
        read_only_root_filesystem,
        run_as_user,
        run_as_non_root,
        capabilities,
        proc_mount,
        ..
    } = sc;
    assert_eq!(*privileged, Some(false), "{}: privileged must stay off", c.name);
    assert_eq!(*allow_privilege_escalation, Some(false), "{}: allowPrivilegeEscalation", c.name);
    assert_eq!(*read_only_root_filesystem, Some(true), "{}: readOnlyRootFilesystem", c.name);
    assert_eq!((*run_as_user, *run_as_non_root), (Some(0), None), "{}: runs as uid 0", c.name);
    assert!(proc_mount.is_none(), "{}: default procMount (read-only /proc/sys)", c.name);
    let caps = capabilities.as_ref().unwrap_or_else(|| panic!("{}: capabilities", c.name));
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]), "{}: drops every capability", c.name);
    let added: Vec<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    let required: Vec<&str> = required.iter().map(|r| r.capability.kubernetes_name()).collect();
    assert_eq!(added, required, "{}: exactly the capabilities the daemon checks for, in its order", c.name);
}

/// The container's command line as our own parser sees it, `$(NODE_NAME)` expanded.
fn parse_command(c: &Container) -> kube_proxy_rs::cmd::cli::DaemonArgs {
    let argv: Vec<String> = c
        .command
        .iter()
        .flatten()
        .chain(c.args.iter().flatten())
        .map(|a| a.replace("$(NODE_NAME)", "node-a"))
        .collect();
    assert_eq!(argv.first().map(String::as_str), Some("/usr/local/bin/kube-proxy-rs"));
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    assert!(cli.command.is_none(), "{argv:?} runs the daemon, not a subcommand");
    cli.daemon
}

#[test]
fn daemon_set_runs_unprivileged_on_every_node_with_host_network() {
    for (file, _, required) in DAEMON_SETS {
        daemon_set_runs_unprivileged(file, required);
    }
}

fn daemon_set_runs_unprivileged(file: &str, required: &[Requirement]) {
    let s = stack(file);
    let ds = &s.daemon_set;
    assert_eq!(ds.metadata.namespace.as_deref(), Some(NAMESPACE));
    assert_eq!(ds.metadata.name.as_deref(), Some(NAME));
    let spec = ds.spec.as_ref().expect("spec");
    let template_labels = spec.template.metadata.as_ref().and_then(|m| m.labels.clone()).unwrap_or_default();
    for (k, v) in spec.selector.match_labels.iter().flatten() {
        assert_eq!(template_labels.get(k), Some(v), "the selector matches the pod template");
    }
    let pod = spec.template.spec.as_ref().expect("pod spec");
    assert_node_level_pod(pod, required);
    assert_eq!(pod.service_account_name.as_deref(), Some(NAME));
    // The daemon reads the API with the service account's token (only what the ClusterRole
    // grants, see rbac_is_exactly_least_privilege).
    assert_ne!(pod.automount_service_account_token, Some(false));
    assert_eq!(pod.node_selector.as_ref().and_then(|n| n.get("kubernetes.io/os")).map(String::as_str), Some("linux"));

    let c = only_container(pod);
    let probe = c.liveness_probe.as_ref().and_then(|p| p.http_get.as_ref()).expect("liveness httpGet");
    assert_eq!(probe.path.as_deref(), Some("/livez"));
    assert_eq!(probe.port, IntOrString::Int(10256));
    let env = c.env.iter().flatten().find(|e| e.name == "NODE_NAME").expect("NODE_NAME env");
    let field = env.value_from.as_ref().and_then(|v| v.field_ref.as_ref()).map(|f| f.field_path.as_str());
    assert_eq!(field, Some("spec.nodeName"));
    // A fixed glibc mmap threshold keeps freed render buffers from staying resident.
    let malloc = c.env.iter().flatten().find(|e| e.name == "MALLOC_MMAP_THRESHOLD_").expect("malloc env");
    assert_eq!(malloc.value.as_deref(), Some("131072"));
}

#[test]
fn daemon_set_command_and_config_map_give_a_valid_configuration() {
    for (file, mode, _) in DAEMON_SETS {
        daemon_set_configuration(file, mode);
    }
}

fn daemon_set_configuration(file: &str, mode: &str) {
    let s = stack(file);
    let pod = s.daemon_set.spec.as_ref().and_then(|d| d.template.spec.as_ref()).expect("pod spec");
    let args = parse_command(only_container(pod));
    assert_eq!(args.hostname_override.as_deref(), Some("node-a"));
    assert!(!args.cleanup && args.write_config_to.is_none() && !args.init_only);
    assert!(options::ignored_flags(&args).is_empty(), "no flag that --config would silently override");

    // --config points into the ConfigMap's mount.
    let config_path = args.config.clone().expect("--config");
    let mount_dir = config_path.parent().and_then(Path::to_str).expect("config dir");
    let (config_volume, read_only) = mount(pod, mount_dir);
    assert!(read_only);
    let cm_ref = config_volume.config_map.as_ref().expect("config volume is the ConfigMap");
    assert_eq!(cm_ref.name, s.config_map.metadata.name.clone().unwrap_or_default());
    assert_eq!(s.config_map.metadata.namespace.as_deref(), Some(NAMESPACE));
    let data = s.config_map.data.clone().unwrap_or_default();
    let key = config_path.file_name().and_then(|n| n.to_str()).expect("file name");
    let text = data.get(key).unwrap_or_else(|| panic!("ConfigMap has no {key}"));

    let raw = config::parse_config(text, Path::new("config.conf"))
        .expect("config.conf parses")
        .into_strict()
        .expect("config.conf decodes strictly");
    assert_eq!(raw.mode, mode, "{file}");
    assert_eq!(raw.clone().with_defaults().validate(), Ok(()));
    let cfg = options::resolve(&args, Some((&config_path, raw))).expect("effective configuration is valid");
    assert_eq!(cfg.mode, mode, "{file}");
    assert_eq!(cfg.hostname_override, "node-a");
    // The probe's port is the health server's.
    assert!(cfg.healthz_bind_address.ends_with(":10256"), "{}", cfg.healthz_bind_address);

    // The kubeconfig the file names is the ConfigMap's other key: the service account's
    // token and CA, and an API server that is not a Service IP.
    let kubeconfig_path = Path::new(&cfg.client_connection.kubeconfig);
    assert_eq!(kubeconfig_path.parent().and_then(Path::to_str), Some(mount_dir));
    let key = kubeconfig_path.file_name().and_then(|n| n.to_str()).expect("kubeconfig file name");
    let kubeconfig: serde_yaml::Value =
        serde_yaml::from_str(data.get(key).unwrap_or_else(|| panic!("ConfigMap has no {key}"))).expect("kubeconfig");
    let user = &kubeconfig["users"][0]["user"];
    assert_eq!(user["tokenFile"].as_str(), Some("/var/run/secrets/kubernetes.io/serviceaccount/token"));
    let cluster = &kubeconfig["clusters"][0]["cluster"];
    assert_eq!(cluster["certificate-authority"].as_str(), Some("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"));
    assert!(cluster["server"].as_str().is_some_and(|s| s.starts_with("https://")), "{cluster:?}");
}

#[test]
fn rbac_is_exactly_least_privilege() {
    for (file, _, _) in DAEMON_SETS {
        rbac_of(file);
    }
}

fn rbac_of(file: &str) {
    let s = stack(file);
    let mut granted = BTreeSet::new();
    for rule in s.role.rules.iter().flatten() {
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none(), "{rule:?}");
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    assert!(!group.contains('*') && !resource.contains('*') && verb != "*", "no wildcards: {rule:?}");
                    granted.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    let expected: BTreeSet<(String, String, String)> = [
        ("", "services", "list"),
        ("", "services", "watch"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
        ("", "nodes", "get"),
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
        // nftables mode drops traffic to unallocated ClusterIPs inside the ServiceCIDRs.
        ("networking.k8s.io", "servicecidrs", "list"),
        ("networking.k8s.io", "servicecidrs", "watch"),
        // Events are posted through events.k8s.io/v1 only (src/k8s/events.rs).
        ("events.k8s.io", "events", "create"),
        ("events.k8s.io", "events", "patch"),
    ]
    .into_iter()
    .map(|(g, r, v)| (g.to_string(), r.to_string(), v.to_string()))
    .collect();
    assert_eq!(granted, expected);

    assert!(s.role.metadata.namespace.is_none(), "a ClusterRole is not namespaced");
    let binding = &s.binding;
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(binding.role_ref.api_group, "rbac.authorization.k8s.io");
    assert_eq!(Some(&binding.role_ref.name), s.role.metadata.name.as_ref());
    let subjects = binding.subjects.as_deref().unwrap_or_default();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(Some(&subjects[0].name), s.service_account.metadata.name.as_ref());
    assert_eq!(subjects[0].namespace.as_deref(), Some(NAMESPACE));
    assert_eq!(s.service_account.metadata.namespace.as_deref(), Some(NAMESPACE));
}

#[test]
fn cleanup_job_runs_cleanup_pinned_to_a_node() {
    let job = cleanup_job();
    assert_eq!(job.metadata.namespace.as_deref(), Some(NAMESPACE));
    assert!(job.metadata.name.as_deref().is_some_and(|n| n.ends_with("NODE_NAME")), "{:?}", job.metadata.name);
    let spec = job.spec.as_ref().expect("job spec");
    assert!(spec.backoff_limit.is_some_and(|b| b > 0));
    let pod = spec.template.spec.as_ref().expect("pod spec");
    // --cleanup removes both modes' rules, iptables-legacy's included: iptables mode's set.
    assert_node_level_pod(pod, REQUIRED);
    assert_eq!(pod.node_name.as_deref(), Some("NODE_NAME"), "pinned by nodeName (a placeholder to replace)");
    assert!(matches!(pod.restart_policy.as_deref(), Some("OnFailure" | "Never")), "{:?}", pod.restart_policy);
    assert_eq!(pod.automount_service_account_token, Some(false), "--cleanup needs no API access");

    let args = parse_command(only_container(pod));
    assert!(args.cleanup, "runs --cleanup");
    assert!(args.config.is_none());
    options::effective_config(&args).expect("the cleanup command line is valid");
}

/// The one init container runs `--init-only` privileged (it writes /proc/sys and /sys), with
/// the daemon's own command line, environment and mounts otherwise, so that it sets exactly
/// the kernel parameters the daemon then finds in place.
#[test]
fn init_container_sets_the_kernel_parameters_privileged() {
    for (file, _, _) in DAEMON_SETS {
        init_container_of(file);
    }
}

fn init_container_of(file: &str) {
    let s = stack(file);
    let pod = s.daemon_set.spec.as_ref().and_then(|d| d.template.spec.as_ref()).expect("pod spec");
    let inits = pod.init_containers.as_deref().unwrap_or_default();
    assert_eq!(inits.len(), 1, "one init container");
    let init = &inits[0];
    let daemon = only_container(pod);
    assert_eq!(init.image, daemon.image);
    assert_eq!(
        init.security_context.as_ref().and_then(|sc| sc.privileged),
        Some(true),
        "the init container is privileged"
    );

    let init_args = parse_command(init);
    assert!(init_args.init_only, "runs --init-only");
    let argv = |c: &Container| c.command.iter().flatten().chain(c.args.iter().flatten()).cloned().collect::<Vec<_>>();
    let mut expected = argv(daemon);
    expected.push("--init-only".into());
    assert_eq!(argv(init), expected, "the daemon's command line plus --init-only");
    assert_eq!(init.env, daemon.env.as_ref().map(|e| e.iter().filter(|v| v.name == "NODE_NAME").cloned().collect()));
    assert_eq!(init.volume_mounts, daemon.volume_mounts, "the same configuration and host mounts");
    assert_host_mounts(pod, init);
}

/// The nftables-mode DaemonSet is the iptables one with `mode: nftables`, the `nftables:`
/// section in place of `iptables:` (the same values, without iptables' localhostNodePorts)
/// and nftables mode's capabilities: every other field is equal, so the two cannot drift.
#[test]
fn nftables_manifest_is_the_iptables_one_but_for_its_mode_and_capabilities() {
    let documents = |file: &str| -> Vec<serde_yaml::Value> {
        let text = std::fs::read_to_string(deploy_dir().join(file)).expect("manifest");
        serde_yaml::Deserializer::from_str(&text).map(|d| serde_yaml::Value::deserialize(d).expect("yaml")).collect()
    };
    let names = |caps: &[Requirement]| -> Vec<String> {
        caps.iter().map(|r| r.capability.kubernetes_name().to_string()).collect()
    };
    let (iptables, mut nftables) = (documents("kube-proxy-rs.yaml"), documents("kube-proxy-rs-nftables.yaml"));
    assert_eq!(iptables.len(), nftables.len());
    let section = "\nnftables:\n  masqueradeAll: false\n  masqueradeBit: 14\n  syncPeriod: 30s\n  minSyncPeriod: 1s\n";
    let iptables_section = section
        .replace("nftables:", "iptables:")
        .replace("masqueradeBit: 14\n", "masqueradeBit: 14\n  localhostNodePorts: true\n");
    let mut changed = 0;
    for doc in &mut nftables {
        match doc["kind"].as_str() {
            Some("ConfigMap") => {
                let text = doc["data"]["config.conf"].as_str().expect("config.conf").to_string();
                assert!(text.contains("\nmode: nftables\n") && text.contains(section), "{text}");
                let as_iptables =
                    text.replace("\nmode: nftables\n", "\nmode: iptables\n").replace(section, &iptables_section);
                doc["data"]["config.conf"] = serde_yaml::Value::String(as_iptables);
                changed += 1;
            }
            Some("DaemonSet") => {
                let caps = &mut doc["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"];
                let added: Vec<String> = caps["add"]
                    .as_sequence()
                    .expect("add")
                    .iter()
                    .filter_map(|c| c.as_str().map(String::from))
                    .collect();
                assert_eq!(added, names(REQUIRED_NFTABLES));
                caps["add"] = serde_yaml::to_value(names(REQUIRED)).expect("yaml");
                changed += 1;
            }
            _ => {}
        }
    }
    assert_eq!(changed, 2, "one ConfigMap and one DaemonSet");
    assert!(nftables == iptables, "the manifests differ beyond mode and capabilities");
}
