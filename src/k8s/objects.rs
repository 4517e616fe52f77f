//! Slim decodings of the watched objects.
//!
//! A watch starts with a list, and API servers answer a list from their cache
//! (`resourceVersion=0`) in one page whatever the page size: at 10k Services that is every
//! EndpointSlice of the cluster decoded at once. Decoded as k8s-openapi objects they take
//! several times what the proxier keeps of them, and the allocator cannot hand that space
//! back once the proxier's long-lived records are scattered through it. So the watches
//! decode only what the proxier reads: [`SliceView`] keeps each endpoint's first address,
//! conditions, node name and zone hints (no target reference, hostname or deprecated
//! topology), and both kinds keep only the metadata the proxier reads (no managed fields,
//! no annotations it does not look at). Each object is turned back into the k8s-openapi
//! type, holding just those fields, as it is handed to the event handlers.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{Service, ServiceSpec, ServiceStatus};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForNode, ForZone,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher::Event;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::model::service::{
    ANNOTATION_LOAD_BALANCER_SOURCE_RANGES, ANNOTATION_TOPOLOGY_AWARE_HINTS, ANNOTATION_TOPOLOGY_MODE,
};
use crate::tracker::endpoints::ANNOTATION_LAST_CHANGE_TRIGGER_TIME;

/// Annotations the proxier reads on Services.
const SERVICE_ANNOTATIONS: &[&str] =
    &[ANNOTATION_TOPOLOGY_MODE, ANNOTATION_TOPOLOGY_AWARE_HINTS, ANNOTATION_LOAD_BALANCER_SOURCE_RANGES];
/// Annotations the proxier reads on EndpointSlices.
const SLICE_ANNOTATIONS: &[&str] = &[ANNOTATION_LAST_CHANGE_TRIGGER_TIME];

/// An EndpointSlice as the watch decodes it (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceView {
    #[serde(default, deserialize_with = "slice_meta")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub address_type: String,
    #[serde(default, deserialize_with = "exact_list")]
    pub endpoints: Box<[EndpointView]>,
    #[serde(default)]
    pub ports: Option<Vec<EndpointPort>>,
}

/// One endpoint of a [`SliceView`].
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointView {
    /// The first of `addresses` (the only one the proxier uses, as upstream).
    #[serde(default, rename = "addresses", deserialize_with = "first_address")]
    pub address: Option<Box<str>>,
    #[serde(default)]
    pub conditions: Option<EndpointConditions>,
    #[serde(default)]
    pub node_name: Option<Box<str>>,
    /// `hints.forZones[].name` and `hints.forNodes[].name`.
    #[serde(default)]
    pub hints: Option<HintsView>,
}

/// Zone or node names from an endpoint's hints.
pub type Names = Box<[Box<str>]>;

/// An endpoint's hints: the names only (an absent or `null` list is no hints of that kind).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HintsView {
    #[serde(default, deserialize_with = "hint_names")]
    pub for_zones: Option<Names>,
    #[serde(default, deserialize_with = "hint_names")]
    pub for_nodes: Option<Names>,
}

impl From<SliceView> for EndpointSlice {
    fn from(view: SliceView) -> EndpointSlice {
        let endpoints = view
            .endpoints
            .into_iter()
            .map(|ep| Endpoint {
                addresses: ep.address.into_iter().map(String::from).collect(),
                conditions: ep.conditions,
                node_name: ep.node_name.map(String::from),
                hints: ep.hints.map(|hints| EndpointHints {
                    for_zones: hints
                        .for_zones
                        .map(|z| z.into_iter().map(|name| ForZone { name: name.into() }).collect()),
                    for_nodes: hints
                        .for_nodes
                        .map(|n| n.into_iter().map(|name| ForNode { name: name.into() }).collect()),
                }),
                ..Default::default()
            })
            .collect();
        EndpointSlice { metadata: view.metadata, address_type: view.address_type, endpoints, ports: view.ports }
    }
}

/// A Service as the watch decodes it: spec and status whole, metadata slim.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ServiceView {
    #[serde(default, deserialize_with = "service_meta")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Option<ServiceSpec>,
    #[serde(default)]
    pub status: Option<ServiceStatus>,
}

impl From<ServiceView> for Service {
    fn from(view: ServiceView) -> Service {
        Service { metadata: view.metadata, spec: view.spec, status: view.status }
    }
}

/// Implements kube's `Resource` for a view by borrowing the type information of the
/// k8s-openapi type it stands for, so the watch asks for the same URLs.
macro_rules! view_resource {
    ($view:ty, $full:ty) => {
        impl kube::Resource for $view {
            type DynamicType = ();
            type Scope = <$full as kube::Resource>::Scope;

            fn kind(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::kind(dt)
            }
            fn group(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::group(dt)
            }
            fn version(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::version(dt)
            }
            fn api_version(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::api_version(dt)
            }
            fn plural(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::plural(dt)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

view_resource!(SliceView, EndpointSlice);
view_resource!(ServiceView, Service);

/// `event` with its object converted (a view into the k8s-openapi type).
pub fn convert_event<V, K: From<V>>(event: Event<V>) -> Event<K> {
    match event {
        Event::Apply(v) => Event::Apply(v.into()),
        Event::Delete(v) => Event::Delete(v.into()),
        Event::Init => Event::Init,
        Event::InitApply(v) => Event::InitApply(v.into()),
        Event::InitDone => Event::InitDone,
    }
}

/// The metadata fields the proxier and the watch read.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SlimMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    /// For the Events about the object (regarding.uid, once per generation).
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    generation: Option<i64>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    annotations: Option<KeptAnnotations>,
}

/// The annotations any watched kind reads (the rest are skipped while decoding, never
/// stored); [`SlimMeta::into_meta`] keeps those of one kind.
struct KeptAnnotations(Vec<(String, String)>);

impl<'de> Deserialize<'de> for KeptAnnotations {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeptAnnotations;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of annotations")
            }
            fn visit_unit<E: de::Error>(self) -> Result<KeptAnnotations, E> {
                Ok(KeptAnnotations(Vec::new()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KeptAnnotations, A::Error> {
                let mut kept = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if SERVICE_ANNOTATIONS.contains(&key.as_str()) || SLICE_ANNOTATIONS.contains(&key.as_str()) {
                        kept.push((key, map.next_value::<String>()?));
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(KeptAnnotations(kept))
            }
        }
        d.deserialize_map(V)
    }
}

impl SlimMeta {
    fn into_meta(self, keep: &[&str]) -> ObjectMeta {
        let annotations: BTreeMap<String, String> = self
            .annotations
            .map(|a| a.0)
            .unwrap_or_default()
            .into_iter()
            .filter(|(k, _)| keep.contains(&k.as_str()))
            .collect();
        ObjectMeta {
            name: self.name,
            namespace: self.namespace,
            resource_version: self.resource_version,
            uid: self.uid,
            generation: self.generation,
            labels: self.labels,
            annotations: (!annotations.is_empty()).then_some(annotations),
            ..Default::default()
        }
    }
}

fn slice_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    Ok(SlimMeta::deserialize(d)?.into_meta(SLICE_ANNOTATIONS))
}

fn service_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    Ok(SlimMeta::deserialize(d)?.into_meta(SERVICE_ANNOTATIONS))
}

/// The first element of a list of strings (`null` or empty: `None`).
fn first_address<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Box<str>>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Option<Box<str>>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list of addresses")
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<Self::Value, D2::Error> {
            d.deserialize_seq(V)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let first = seq.next_element::<Box<str>>()?;
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(first)
        }
    }
    d.deserialize_option(V)
}

/// A list (`null`: empty) in an allocation of exactly its length: serde grows vectors by
/// doubling, and a page holds one such list per object.
fn exact_list<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Box<[T]>, D::Error> {
    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default().into_boxed_slice())
}

/// The `name`s of a `forZones` or `forNodes` list.
fn hint_names<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Names>, D::Error> {
    #[derive(Deserialize)]
    struct Named {
        name: Box<str>,
    }
    let list = Option::<Vec<Named>>::deserialize(d)?;
    Ok(list.map(|names| names.into_iter().map(|n| n.name).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An EndpointSlice as an API server sends it, with fields the proxier ignores.
    const SLICE: &str = r#"{
      "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
      "metadata": {
        "name": "web-abc", "namespace": "ns1", "resourceVersion": "42", "uid": "u-1",
        "labels": {"kubernetes.io/service-name": "web", "app": "web"},
        "annotations": {
          "endpoints.kubernetes.io/last-change-trigger-time": "2024-01-02T03:04:05Z",
          "kubectl.kubernetes.io/last-applied-configuration": "{\"huge\": true}"
        },
        "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                           "fieldsType": "FieldsV1", "fieldsV1": {"f:endpoints": {}}}]
      },
      "addressType": "IPv4",
      "endpoints": [
        {"addresses": ["10.0.0.1", "10.0.0.9"], "conditions": {"ready": true, "serving": true, "terminating": false},
         "nodeName": "node-1", "hostname": "pod-1", "zone": "z1",
         "targetRef": {"kind": "Pod", "namespace": "ns1", "name": "pod-1", "uid": "p-1"},
         "hints": {"forZones": [{"name": "z1"}]}},
        {"addresses": [], "conditions": {"ready": false}},
        {"addresses": null}
      ],
      "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}]
    }"#;

    #[test]
    fn slice_view_keeps_what_the_proxier_reads() {
        let view: SliceView = serde_json::from_str(SLICE).expect("decodes");
        let slice = EndpointSlice::from(view);
        let full: EndpointSlice = serde_json::from_str(SLICE).expect("decodes");

        assert_eq!(slice.metadata.name, full.metadata.name);
        assert_eq!(slice.metadata.namespace, full.metadata.namespace);
        assert_eq!(slice.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(slice.metadata.labels, full.metadata.labels);
        let annotations = slice.metadata.annotations.as_ref().expect("trigger time kept");
        assert_eq!(annotations.keys().collect::<Vec<_>>(), [ANNOTATION_LAST_CHANGE_TRIGGER_TIME]);
        assert!(slice.metadata.managed_fields.is_none() && slice.metadata.uid.as_deref() == Some("u-1"));
        assert_eq!(slice.address_type, "IPv4");
        assert_eq!(slice.ports, full.ports);

        assert_eq!(slice.endpoints.len(), 3);
        let (ep, orig) = (&slice.endpoints[0], &full.endpoints[0]);
        assert_eq!(ep.addresses, ["10.0.0.1"], "only the first address is used");
        assert_eq!(ep.conditions, orig.conditions);
        assert_eq!(ep.node_name, orig.node_name);
        assert_eq!(ep.hints, orig.hints);
        assert!(ep.target_ref.is_none() && ep.hostname.is_none() && ep.zone.is_none());
        assert!(slice.endpoints[1].addresses.is_empty());
        assert_eq!(slice.endpoints[1].conditions, full.endpoints[1].conditions);
        assert!(slice.endpoints[2].addresses.is_empty());
    }

    #[test]
    fn slice_view_gives_the_proxier_the_same_endpoints() {
        use crate::model::IpFamily;
        use crate::tracker::{EndpointChangeTracker, EndpointsMap};
        let endpoints = |slice: &EndpointSlice| {
            let mut tracker = EndpointChangeTracker::new("node-1", IpFamily::V4);
            assert!(tracker.endpoint_slice_update(slice, false));
            let mut map = EndpointsMap::new();
            map.update(&mut tracker);
            map
        };
        let full: EndpointSlice = serde_json::from_str(SLICE).expect("decodes");
        let view: SliceView = serde_json::from_str(SLICE).expect("decodes");
        let slim = endpoints(&EndpointSlice::from(view));
        assert_eq!(slim, endpoints(&full));
        assert_eq!(slim.values().map(Vec::len).sum::<usize>(), 1);
    }

    #[test]
    fn empty_and_null_fields_decode() {
        let view: SliceView = serde_json::from_str(
            r#"{"metadata": {"name": "s"}, "addressType": "IPv6", "endpoints": null, "ports": null}"#,
        )
        .expect("decodes");
        let slice = EndpointSlice::from(view);
        assert!(slice.endpoints.is_empty() && slice.ports.is_none());
        assert_eq!(slice.metadata.annotations, None);
    }

    #[test]
    fn service_view_keeps_spec_status_and_read_annotations() {
        let text = r#"{
          "apiVersion": "v1", "kind": "Service",
          "metadata": {"name": "web", "namespace": "ns1", "resourceVersion": "7",
            "annotations": {"service.kubernetes.io/topology-mode": "Auto", "other": "x",
              "service.beta.kubernetes.io/load-balancer-source-ranges": "10.0.0.0/8"},
            "managedFields": [{"manager": "kubectl"}]},
          "spec": {"type": "ClusterIP", "clusterIP": "172.30.0.1", "clusterIPs": ["172.30.0.1"],
                   "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
          "status": {"loadBalancer": {}}
        }"#;
        let svc = Service::from(serde_json::from_str::<ServiceView>(text).expect("decodes"));
        let full: Service = serde_json::from_str(text).expect("decodes");
        assert_eq!(svc.spec, full.spec);
        assert_eq!(svc.status, full.status);
        assert_eq!(svc.metadata.resource_version.as_deref(), Some("7"));
        let kept: Vec<&String> = svc.metadata.annotations.as_ref().expect("kept").keys().collect();
        assert_eq!(kept, [ANNOTATION_LOAD_BALANCER_SOURCE_RANGES, ANNOTATION_TOPOLOGY_MODE]);
        assert!(svc.metadata.managed_fields.is_none());
    }

    #[test]
    fn views_ask_for_the_same_urls() {
        use kube::Resource;
        assert_eq!(SliceView::url_path(&(), None), EndpointSlice::url_path(&(), None));
        assert_eq!(SliceView::url_path(&(), Some("ns1")), EndpointSlice::url_path(&(), Some("ns1")));
        assert_eq!(ServiceView::url_path(&(), None), Service::url_path(&(), None));
        assert_eq!(ServiceView::kind(&()), "Service");
    }
}
