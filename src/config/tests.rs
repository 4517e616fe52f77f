//! Tests of the config file: durations, defaults, decoding, validation, settings.

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use super::*;
use crate::model::Cidr;

/// Decodes, requiring strict decoding to succeed.
fn parse(text: &str) -> Result<KubeProxyConfiguration, ConfigError> {
    let decoded = parse_decoded(text)?;
    assert!(decoded.strict_errors.is_empty(), "not strict: {}", decoded.strict_error_text());
    Ok(decoded.config)
}

fn parse_decoded(text: &str) -> Result<DecodedConfig, ConfigError> {
    parse_config(text, Path::new("test.yaml"))
}

const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

fn defaulted() -> KubeProxyConfiguration {
    KubeProxyConfiguration::default().with_defaults()
}

/// Validates and returns the field paths of the errors.
fn error_fields(cfg: &KubeProxyConfiguration) -> Vec<String> {
    match cfg.validate() {
        Ok(()) => Vec::new(),
        Err(errs) => errs.into_iter().map(|e| e.field).collect(),
    }
}

#[test]
fn duration_parse_accepts_go_syntax() {
    let cases: &[(&str, i64)] = &[
        ("0", 0),
        ("-0", 0),
        ("30s", 30_000_000_000),
        ("1m0s", 60_000_000_000),
        ("1h2m3.5s", 3_723_500_000_000),
        ("1.5ms", 1_500_000),
        ("100ns", 100),
        ("1us", 1_000),
        ("1µs", 1_000),
        ("1μs", 1_000),
        ("-2h", -7_200_000_000_000),
        ("+5s", 5_000_000_000),
        ("5.s", 5_000_000_000),
        (".5s", 500_000_000),
        ("0.000000001s", 1),
        ("9223372036854775807ns", i64::MAX),
        ("-9223372036854775808ns", i64::MIN),
    ];
    for (text, nanos) in cases {
        assert_eq!(GoDuration::parse(text), Ok(GoDuration(*nanos)), "{text}");
    }
}

#[test]
fn duration_parse_rejects_like_go() {
    assert_eq!(GoDuration::parse(""), Err(DurationError::Invalid(String::new())));
    assert_eq!(GoDuration::parse("1"), Err(DurationError::MissingUnit("1".into())));
    assert!(matches!(GoDuration::parse("1x"), Err(DurationError::UnknownUnit { .. })));
    for bad in [".s", "s", "-", "1s2", "9223372036854775808ns", "1.2.3s", "3000000h"] {
        assert!(GoDuration::parse(bad).is_err(), "{bad} should be rejected");
    }
    assert_eq!(GoDuration::parse("5 s").unwrap_err().to_string(), "time: unknown unit \" s\" in duration \"5 s\"");
}

#[test]
fn duration_formats_like_go() {
    let cases: &[(i64, &str)] = &[
        (0, "0s"),
        (1, "1ns"),
        (1_100, "1.1µs"),
        (2_200_000, "2.2ms"),
        (1_000_000_000, "1s"),
        (1_500_000_000, "1.5s"),
        (60_000_000_000, "1m0s"),
        (90_000_000_000, "1m30s"),
        (900_000_000_000, "15m0s"),
        (86_400_000_000_000, "24h0m0s"),
        (3_723_500_000_000, "1h2m3.5s"),
        (-1_000_000_000, "-1s"),
        (i64::MAX, "2562047h47m16.854775807s"),
        (i64::MIN, "-2562047h47m16.854775808s"),
    ];
    for (nanos, text) in cases {
        assert_eq!(GoDuration(*nanos).to_string(), *text);
        assert_eq!(GoDuration::parse(text), Ok(GoDuration(*nanos)), "re-parse {text}");
    }
}

#[test]
fn defaults_match_upstream() {
    let cfg = defaulted();
    assert_eq!(cfg.bind_address, "0.0.0.0");
    assert_eq!(cfg.healthz_bind_address, "0.0.0.0:10256");
    assert_eq!(cfg.metrics_bind_address, "127.0.0.1:10249");
    assert_eq!(cfg.oom_score_adj, Some(-999));
    assert_eq!(cfg.iptables.masquerade_bit, Some(14));
    assert_eq!(cfg.iptables.localhost_node_ports, Some(true));
    assert_eq!(cfg.iptables.sync_period.to_string(), "30s");
    assert_eq!(cfg.iptables.min_sync_period.to_string(), "1s");
    assert_eq!(cfg.ipvs.sync_period.to_string(), "30s");
    assert_eq!(cfg.ipvs.min_sync_period, GoDuration::ZERO);
    assert_eq!(cfg.nftables.masquerade_bit, Some(14));
    assert_eq!(cfg.conntrack.max_per_core, Some(32768));
    assert_eq!(cfg.conntrack.min, Some(131072));
    assert_eq!(cfg.conntrack.tcp_established_timeout.unwrap().to_string(), "24h0m0s");
    assert_eq!(cfg.conntrack.tcp_close_wait_timeout.unwrap().to_string(), "1h0m0s");
    assert_eq!(cfg.conntrack.udp_timeout, GoDuration::ZERO);
    assert_eq!(cfg.config_sync_period.to_string(), "15m0s");
    assert_eq!(cfg.client_connection.content_type, "application/vnd.kubernetes.protobuf");
    assert_eq!(cfg.client_connection.qps, 5.0);
    assert_eq!(cfg.client_connection.burst, 10);
    assert_eq!(cfg.logging.format, "text");
    assert_eq!(cfg.logging.flush_frequency.duration.to_string(), "5s");
    assert_eq!(cfg.mode, "");
    assert_eq!(cfg.detect_local_mode, "");
    assert_eq!(cfg.clone().with_defaults(), cfg, "defaulting is idempotent");
    assert_eq!(cfg.validate(), Ok(()));
}

#[test]
fn defaults_follow_bind_address_family() {
    let cfg = KubeProxyConfiguration { bind_address: "fd00::1".into(), ..Default::default() };
    let cfg = cfg.with_defaults();
    assert_eq!(cfg.healthz_bind_address, "[::]:10256");
    assert_eq!(cfg.metrics_bind_address, "[::1]:10249");

    let cfg = KubeProxyConfiguration {
        healthz_bind_address: "10.0.0.1".into(),
        metrics_bind_address: "::1".into(),
        ..Default::default()
    };
    let cfg = cfg.with_defaults();
    assert_eq!(cfg.healthz_bind_address, "10.0.0.1:10256");
    assert_eq!(cfg.metrics_bind_address, "[::1]:10249");
}

#[test]
fn minimal_file_loads_and_defaults() {
    let cfg = parse(HEADER).unwrap();
    assert_eq!(cfg, KubeProxyConfiguration::default());
    let text = format!(
        "{HEADER}mode: iptables\nclusterCIDR: 10.244.0.0/16\niptables:\n  masqueradeBit: null\n  syncPeriod: 10s\nhostnameOverride: null\n"
    );
    let cfg = parse(&text).unwrap().with_defaults();
    assert_eq!(cfg.iptables.masquerade_bit, Some(14));
    assert_eq!(cfg.iptables.sync_period.to_string(), "10s");
    assert_eq!(cfg.hostname_override, "");
}

#[test]
fn kubeadm_style_file_with_nulls_loads() {
    let text = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
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
mode: ""
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
"#;
    let cfg = parse(text).unwrap().with_defaults();
    assert_eq!(cfg.validate(), Ok(()));
    let settings = Settings::from_config(&cfg).unwrap();
    assert_eq!(settings.client.kubeconfig, Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf")));
    assert_eq!(settings.cluster_cidrs, vec![Cidr::parse_sloppy("10.244.0.0/16").unwrap()]);
}

#[test]
fn to_yaml_round_trips() {
    let cfg = defaulted();
    let yaml = cfg.to_yaml();
    assert!(yaml.starts_with("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"), "{yaml}");
    for needle in [
        "masqueradeBit: 14",
        "syncPeriod: 30s",
        "minSyncPeriod: 1s",
        "tcpEstablishedTimeout: 24h0m0s",
        "configSyncPeriod: 15m0s",
        "qps: 5\n",
        "oomScoreAdj: -999",
        "nodePortAddresses: null",
        "kind: KubeProxyConfiguration",
    ] {
        assert!(yaml.contains(needle), "missing {needle:?} in\n{yaml}");
    }
    assert_eq!(parse(&yaml).unwrap(), cfg);

    let mut custom = defaulted();
    custom.feature_gates.insert("SomeGate".into(), true);
    custom.node_port_addresses = Some(vec!["10.0.0.0/8".into(), "fd00::/64".into()]);
    custom.client_connection.qps = 0.5;
    custom.logging.flush_frequency = FlushFrequency { duration: GoDuration(2_000_000_000), as_string: false };
    custom.logging.vmodule = Some(vec![VModuleItem { file_pattern: "proxier*".into(), verbosity: 4 }]);
    custom.hostname_override = "null".into();
    custom.port_range = "30000-32767".into();
    custom.iptables.min_sync_period = GoDuration(1_500_000);
    let yaml = custom.to_yaml();
    assert!(yaml.contains("qps: 0.5"), "{yaml}");
    assert!(yaml.contains("flushFrequency: 2000000000"), "{yaml}");
    assert_eq!(parse(&yaml).unwrap(), custom, "{yaml}");
}

#[test]
fn unknown_fields_are_skipped_and_reported_as_upstreams_strict_errors() {
    // A field from a newer release (or a stray one) must not cost the node its proxy:
    // upstream decodes leniently and logs the strict decoding error.
    let text = format!("{HEADER}mode: iptables\niptables:\n  masqueradeBits: 3\n  syncPeriod: 10s\nbogus: 1\n");
    let decoded = parse_decoded(&text).expect("decodes leniently");
    assert!(decoded.is_lenient());
    assert_eq!(
        decoded.strict_errors,
        vec![
            StrictDecodingError::UnknownField("iptables.masqueradeBits".into()),
            StrictDecodingError::UnknownField("bogus".into()),
        ]
    );
    assert_eq!(
        decoded.strict_error_text(),
        r#"strict decoding error: unknown field "iptables.masqueradeBits", unknown field "bogus""#
    );
    // Everything it knows is read as usual.
    assert_eq!(decoded.config.mode, "iptables");
    assert_eq!(decoded.config.iptables.sync_period, GoDuration::from_secs(10));

    let strict = parse_decoded(&format!("{HEADER}mode: iptables\n")).expect("decodes");
    assert!(!strict.is_lenient() && strict.strict_errors.is_empty());
}

#[test]
fn duplicated_fields_take_the_last_value_and_are_reported() {
    let text =
        format!("{HEADER}mode: ipvs\nclusterCIDR: 198.18.0.0/16\nmode: iptables\nconntrack:\n  min: 1\n  min: 2\n");
    let decoded = parse_decoded(&text).expect("decodes leniently");
    assert_eq!(decoded.config.mode, "iptables");
    assert_eq!(decoded.config.conntrack.min, Some(2));
    assert_eq!(decoded.config.cluster_cidr, "198.18.0.0/16");
    assert_eq!(
        decoded.strict_errors,
        vec![
            StrictDecodingError::DuplicateField("mode".into()),
            StrictDecodingError::DuplicateField("conntrack.min".into())
        ]
    );
    // Both kinds at once.
    let both =
        parse_decoded(&format!("{HEADER}mode: a\nmode: iptables\nfuture: {{x: 1}}\n")).expect("decodes leniently");
    assert_eq!(both.strict_error_text(), r#"strict decoding error: duplicate field "mode", unknown field "future""#);
}

#[test]
fn lenient_decoding_still_rejects_malformed_yaml_and_wrong_types() {
    // Wrong types stay errors naming the field and line, with or without an unknown field.
    let err = parse_decoded(&format!("{HEADER}bogus: 1\niptables:\n  masqueradeBit: x\n")).unwrap_err();
    let ConfigError::Decode { location, message, .. } = &err else { panic!("{err}") };
    assert_eq!(location.map(|l| l.0), Some(5), "{err}");
    assert!(message.starts_with("iptables.masqueradeBit: invalid type"), "{message}");
    // A wrong type beside a duplicated key: still an error, naming the field.
    let err = parse_decoded(&format!("{HEADER}mode: a\nmode: b\nconntrack:\n  min: many\n")).unwrap_err();
    assert!(err.to_string().contains("min") && err.to_string().contains("invalid"), "{err}");
    // Malformed YAML.
    let err = parse(&format!("{HEADER}iptables: [\n")).unwrap_err();
    assert!(matches!(err, ConfigError::Decode { .. }), "{err}");
    assert!(err.to_string().starts_with("test.yaml:"), "{err}");
}

#[test]
fn wrong_types_name_the_field() {
    let err = parse(&format!("{HEADER}iptables:\n  masqueradeBit: x\n")).unwrap_err();
    assert!(err.to_string().contains("iptables.masqueradeBit: invalid type"), "{err}");
    // Durations must be strings, as with metav1.Duration.
    let err = parse(&format!("{HEADER}configSyncPeriod: 30\n")).unwrap_err();
    assert!(err.to_string().contains("configSyncPeriod"), "{err}");
    let err = parse(&format!("{HEADER}iptables:\n  syncPeriod: 3 seconds\n")).unwrap_err();
    assert!(err.to_string().contains("iptables.syncPeriod: time: unknown unit"), "{err}");
    let err = parse(&format!("{HEADER}iptables: [\n")).unwrap_err();
    assert!(matches!(err, ConfigError::Decode { location: Some(_), .. }), "{err}");
}

#[test]
fn wrong_type_meta_is_rejected() {
    let err = parse("apiVersion: v1\nkind: KubeProxyConfiguration\n").unwrap_err();
    assert!(matches!(err, ConfigError::ApiVersion { ref found, .. } if found == "v1"), "{err}");
    let err = parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n").unwrap_err();
    assert!(matches!(err, ConfigError::Kind { ref found, .. } if found == "KubeletConfiguration"));
    let err = parse("kind: KubeProxyConfiguration\n").unwrap_err();
    assert!(matches!(err, ConfigError::ApiVersion { ref found, .. } if found.is_empty()));
    let err = parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n").unwrap_err();
    assert!(matches!(err, ConfigError::Kind { .. }));
    assert!(matches!(parse("# nothing\n\n").unwrap_err(), ConfigError::Empty { .. }));
    assert!(matches!(parse("- a\n- b\n").unwrap_err(), ConfigError::Decode { .. }));
}

#[test]
fn load_config_file_names_the_file() {
    let err = load_config_file("/nonexistent/kube-proxy-rs/config.yaml").unwrap_err();
    assert!(matches!(err, ConfigError::Read { .. }));
    assert!(err.to_string().starts_with("/nonexistent/kube-proxy-rs/config.yaml: cannot read"), "{err}");

    let path = std::env::temp_dir().join(format!("kube-proxy-rs-config-{}.yaml", std::process::id()));
    std::fs::write(&path, format!("{HEADER}mode: iptables\n")).unwrap();
    let cfg = load_config_file(&path).unwrap().config;
    std::fs::remove_file(&path).unwrap();
    assert_eq!(cfg.mode, "iptables");
}

#[test]
fn validation_names_each_field() {
    type Mutate = fn(&mut KubeProxyConfiguration);
    let cases: Vec<(Mutate, &[&str])> = vec![
        (|c| c.iptables.masquerade_bit = Some(32), &["iptables.masqueradeBit"]),
        (|c| c.iptables.masquerade_bit = Some(-1), &["iptables.masqueradeBit"]),
        (|c| c.iptables.sync_period = GoDuration::ZERO, &["iptables.syncPeriod", "iptables.syncPeriod"]),
        (|c| c.iptables.min_sync_period = GoDuration(-1), &["iptables.minSyncPeriod"]),
        (|c| c.iptables.min_sync_period = GoDuration::from_secs(60), &["iptables.syncPeriod"]),
        (|c| c.cluster_cidr = "10.0.0.0".into(), &["clusterCIDR"]),
        (|c| c.cluster_cidr = "10.0.0.0/8,10.1.0.0/16".into(), &["clusterCIDR"]),
        (|c| c.cluster_cidr = "10.0.0.0/8,fd00::/48,10.1.0.0/16".into(), &["clusterCIDR"]),
        (|c| c.cluster_cidr = "10.0.0.0/8, fd00::/48".into(), &["clusterCIDR"]),
        (|c| c.node_port_addresses = Some(vec!["10.0.0.0/8".into(), "x".into()]), &["nodePortAddresses[1]"]),
        (
            |c| {
                c.compatibility_version = "1.36".into();
                c.node_port_addresses = Some(vec!["10.0.0.0/8".into(), "primary".into()]);
            },
            &["nodePortAddresses[1]"],
        ),
        (
            |c| {
                c.compatibility_version = "1.36".into();
                c.node_port_addresses = Some(vec!["localhost".into()]);
            },
            &["nodePortAddresses[0]"],
        ),
        (|c| c.node_port_addresses = Some(vec!["all".into(), "everything".into()]), &["nodePortAddresses[1]"]),
        (|c| c.bind_address = "10.0.0.1:80".into(), &["bindAddress"]),
        (|c| c.healthz_bind_address = "0.0.0.0".into(), &["healthzBindAddress"]),
        (|c| c.metrics_bind_address = "localhost:10249".into(), &["metricsBindAddress"]),
        (|c| c.metrics_bind_address = "127.0.0.1:0".into(), &["metricsBindAddress"]),
        (|c| c.detect_local_mode = "Guess".into(), &["detectLocalMode"]),
        (|c| c.detect_local_mode = "BridgeInterface".into(), &["detectLocal.bridgeInterface"]),
        (|c| c.detect_local_mode = "InterfaceNamePrefix".into(), &["detectLocal.interfaceNamePrefix"]),
        (|c| c.mode = "ipvs".into(), &["mode"]),
        (|c| c.mode = "userspace".into(), &["mode"]),
        (|c| c.oom_score_adj = Some(1001), &["oomScoreAdj"]),
        (|c| c.conntrack.max_per_core = Some(-1), &["conntrack.maxPerCore"]),
        (|c| c.conntrack.min = Some(-1), &["conntrack.min"]),
        (|c| c.conntrack.tcp_established_timeout = Some(GoDuration(-1)), &["conntrack.tcpEstablishedTimeout"]),
        (|c| c.conntrack.tcp_close_wait_timeout = Some(GoDuration(-1)), &["conntrack.tcpCloseWaitTimeout"]),
        (|c| c.conntrack.udp_timeout = GoDuration(-1), &["conntrack.udpTimeout"]),
        (|c| c.conntrack.udp_stream_timeout = GoDuration(-1), &["conntrack.udpStreamTimeout"]),
        (|c| c.client_connection.burst = -1, &["clientConnection.burst"]),
        (|c| c.config_sync_period = GoDuration(-1), &["configSyncPeriod"]),
        (|c| c.port_range = "2000-1000".into(), &["portRange"]),
        (|c| c.port_range = "a-b".into(), &["portRange"]),
        (|c| c.show_hidden_metrics_for_version = "1.20".into(), &["showHiddenMetricsForVersion"]),
        (|c| c.show_hidden_metrics_for_version = "1.28".into(), &["showHiddenMetricsForVersion"]),
        (|c| c.compatibility_version = "1.28".into(), &["compatibilityVersion"]),
        (|c| c.compatibility_version = "latest".into(), &["compatibilityVersion"]),
        (
            |c| {
                c.compatibility_version = "1.32".into();
                c.feature_gates.insert("LoadBalancerIPMode".into(), false);
            },
            &["featureGates"],
        ),
        (
            |c| {
                c.compatibility_version = "1.30".into();
                c.node_port_addresses = Some(vec!["primary".into()]);
            },
            &["nodePortAddresses[0]"],
        ),
        (|c| c.logging.format = "xml".into(), &["logging.format"]),
        (|c| c.hostname_override = "  ".into(), &["hostnameOverride"]),
    ];
    for (i, (mutate, expected)) in cases.into_iter().enumerate() {
        let mut cfg = defaulted();
        mutate(&mut cfg);
        assert_eq!(error_fields(&cfg), expected.to_vec(), "case {i}");
    }
}

#[test]
fn validation_accepts_valid_variants() {
    type Mutate = fn(&mut KubeProxyConfiguration);
    let cases: Vec<Mutate> = vec![
        |c| c.mode = "iptables".into(),
        |c| c.cluster_cidr = "10.0.0.0/8,fd00::/48".into(),
        |c| c.cluster_cidr = "fd00::/48".into(),
        |c| c.node_port_addresses = Some(vec!["primary".into()]),
        |c| c.node_port_addresses = Some(vec!["127.0.0.0/8".into(), "::1/128".into()]),
        |c| c.healthz_bind_address = String::new(),
        |c| c.metrics_bind_address = "[::]:10249".into(),
        |c| c.bind_address = "010.000.000.001".into(),
        |c| c.iptables.min_sync_period = GoDuration::from_secs(30),
        |c| c.detect_local_mode = "NodeCIDR".into(),
        |c| {
            c.detect_local_mode = "BridgeInterface".into();
            c.detect_local.bridge_interface = "cbr0".into();
        },
        |c| c.port_range = "30000+100".into(),
        |c| c.show_hidden_metrics_for_version = "1.36".into(),
        // 1.37: keywords and CIDRs in any combination.
        |c| c.node_port_addresses = Some(vec!["primary".into(), "localhost".into(), "10.0.0.0/8".into()]),
        |c| c.node_port_addresses = Some(vec!["all".into()]),
        |c| {
            c.compatibility_version = "1.29".into();
            c.show_hidden_metrics_for_version = "1.28".into();
        },
        |c| c.compatibility_version = "v1.31.2".into(),
        |c| c.node_port_addresses = Some(vec!["primary".into()]),
        |c| c.logging.format = "json".into(),
    ];
    for (i, mutate) in cases.into_iter().enumerate() {
        let mut cfg = defaulted();
        mutate(&mut cfg);
        assert_eq!(cfg.validate(), Ok(()), "case {i}");
    }
}

#[test]
fn field_errors_render_like_kubernetes() {
    let mut cfg = defaulted();
    cfg.iptables.masquerade_bit = Some(40);
    cfg.detect_local_mode = "Guess".into();
    let errs = cfg.validate().unwrap_err();
    assert_eq!(errs[0].to_string(), "iptables.masqueradeBit: Invalid value: 40: must be within the range [0, 31]");
    assert_eq!(errs[0].value, "40");
    assert_eq!(
        errs[1].to_string(),
        "detectLocalMode: Unsupported value: \"Guess\": supported values: \"ClusterCIDR\", \
             \"NodeCIDR\", \"BridgeInterface\", \"InterfaceNamePrefix\", \"\""
    );
    cfg = defaulted();
    cfg.mode = "ipvs".into();
    let errs = cfg.validate().unwrap_err();
    assert!(errs[0].to_string().contains("iptables and nftables proxy modes"), "{}", errs[0]);
}

#[test]
fn nftables_mode_takes_its_own_section_as_upstreams_conversion_does() {
    let cfg = parse(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n\
         iptables: {masqueradeBit: 3, masqueradeAll: false, syncPeriod: 10s, minSyncPeriod: 2s}\n\
         nftables: {masqueradeBit: 9, masqueradeAll: true, syncPeriod: 20s, minSyncPeriod: 500ms}\n",
    )
    .unwrap();
    let s = Settings::from_config(&cfg).unwrap();
    assert_eq!(s.mode, ProxyMode::Nftables);
    assert_eq!((s.masquerade_bit, s.masquerade_mark.as_str(), s.masquerade_all), (9, "0x00000200", true));
    assert_eq!((s.sync_period, s.min_sync_period), (Duration::from_secs(20), Duration::from_millis(500)));

    // The same file in iptables mode takes the iptables section.
    let mut ipt = cfg.clone();
    ipt.mode = String::new();
    let s = Settings::from_config(&ipt).unwrap();
    assert_eq!(s.mode, ProxyMode::Iptables);
    assert_eq!((s.masquerade_bit, s.masquerade_all), (3, false));
    assert_eq!((s.sync_period, s.min_sync_period), (Duration::from_secs(10), Duration::from_secs(2)));

    // Defaults of the nftables section.
    let mut bare = defaulted();
    bare.mode = "nftables".into();
    let s = Settings::from_config(&bare).unwrap();
    assert_eq!(
        (s.masquerade_bit, s.sync_period, s.min_sync_period),
        (14, Duration::from_secs(30), Duration::from_secs(1))
    );
}

#[test]
fn nftables_section_is_validated_in_nftables_mode_only() {
    let mut cfg = defaulted();
    cfg.nftables.masquerade_bit = Some(40);
    cfg.nftables.min_sync_period = GoDuration::from_secs(60);
    assert!(cfg.validate().is_ok(), "iptables mode ignores the nftables section");
    cfg.mode = "nftables".into();
    let errs: Vec<String> = cfg.validate().unwrap_err().iter().map(ToString::to_string).collect();
    assert!(errs.iter().any(|e| e.starts_with("nftables.masqueradeBit: Invalid value: 40")), "{errs:?}");
    assert!(
        errs.iter().any(|e| e.starts_with("nftables.syncPeriod") && e.contains("nftables.minSyncPeriod")),
        "{errs:?}"
    );
}

#[test]
fn nftables_mode_needs_a_release_that_has_it_and_its_gate() {
    let mut cfg = defaulted();
    cfg.mode = "nftables".into();
    for (version, ok) in [("1.29", false), ("1.30", false), ("1.31", true), ("1.33", true), ("1.37", true)] {
        cfg.compatibility_version = version.into();
        let result = cfg.validate();
        assert_eq!(result.is_ok(), ok, "{version}: {result:?}");
        if let Err(errs) = result {
            assert!(errs[0].to_string().starts_with("mode: Invalid value: \"nftables\""), "{}", errs[0]);
            assert!(errs[0].to_string().contains("1.31 and later"), "{}", errs[0]);
        }
    }
    cfg.compatibility_version = "1.32".into();
    cfg.feature_gates.insert("NFTablesProxyMode".into(), false);
    let errs = cfg.validate().unwrap_err();
    assert!(errs[0].to_string().contains("NFTablesProxyMode is disabled"), "{}", errs[0]);
    // GA and locked from 1.33: turning it off is refused as for any locked gate.
    cfg.compatibility_version = "1.33".into();
    let errs = cfg.validate().unwrap_err();
    assert!(errs[0].to_string().starts_with("featureGates"), "{}", errs[0]);
}

#[test]
fn masquerade_mark_formats_like_go_percent_hash_08x() {
    // Go pads the digits to eight and then prepends 0x (kube-proxy writes 0x00004000).
    assert_eq!(masquerade_mark(0), "0x00000001");
    assert_eq!(masquerade_mark(14), "0x00004000");
    assert_eq!(masquerade_mark(31), "0x80000000");
}

#[test]
fn settings_from_config() {
    let mut cfg = KubeProxyConfiguration {
        hostname_override: "  Node-A ".into(),
        cluster_cidr: "10.244.0.0/16,fd00:10:244::/56".into(),
        ..Default::default()
    };
    cfg.iptables.masquerade_bit = Some(31);
    cfg.iptables.localhost_node_ports = Some(false);
    let s = Settings::from_config(&cfg).unwrap();
    assert_eq!(s.hostname_override.as_deref(), Some("node-a"));
    assert_eq!(s.masquerade_mark, "0x80000000");
    assert_eq!(s.masquerade_bit, 31);
    assert!(!s.localhost_nodeports);
    assert_eq!(s.sync_period, Duration::from_secs(30));
    assert_eq!(s.min_sync_period, Duration::from_secs(1));
    assert_eq!(s.config_sync_period, Duration::from_secs(900));
    assert_eq!(s.bind_address, IpAddr::from([0, 0, 0, 0]));
    assert_eq!(s.healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()));
    assert_eq!(s.metrics_bind_address, Some("127.0.0.1:10249".parse().unwrap()));
    assert_eq!(s.cluster_cidrs.len(), 2);
    assert_eq!(s.detect_local, DetectLocal::ClusterCidr(s.cluster_cidrs.clone()));
    assert_eq!(s.conntrack.max_per_core, 32768);
    assert_eq!(s.conntrack.tcp_established_timeout, Duration::from_secs(86400));
    assert_eq!(s.oom_score_adj, -999);
    assert_eq!(s.client.kubeconfig, None);

    cfg.detect_local_mode = "InterfaceNamePrefix".into();
    cfg.detect_local.interface_name_prefix = "veth".into();
    let s = Settings::from_config(&cfg).unwrap();
    assert_eq!(s.detect_local, DetectLocal::InterfaceNamePrefix("veth".into()));

    cfg.iptables.masquerade_bit = Some(99);
    let errs = Settings::from_config(&cfg).unwrap_err();
    assert_eq!(errs[0].field, "iptables.masqueradeBit");
}

#[test]
fn files_written_by_newer_releases_load() {
    // 1.31 added windowsRunAsService (omitempty); our extension field rides along.
    let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                    windowsRunAsService: true\ncompatibilityVersion: \"1.31\"\n";
    let cfg = parse_config(text, Path::new("c.yaml")).expect("loads");
    assert!(!cfg.is_lenient());
    let cfg = cfg.config;
    assert!(cfg.windows_run_as_service);
    let settings = Settings::from_config(&cfg).expect("valid");
    assert_eq!(settings.features.release, crate::compat::Release::V1_31);
    // Neither is written back when unset, so our files stay readable by upstream.
    let written = serde_yaml::to_string(&KubeProxyConfiguration::default().with_defaults()).expect("yaml");
    assert!(!written.contains("windowsRunAsService") && !written.contains("compatibilityVersion"), "{written}");
}
