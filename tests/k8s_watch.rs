
/// The server answers kube's own requests as the API server would: selectors, list versions,
/// watch event types, 410 Gone and error statuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_speaks_the_api() {
    use futures::{StreamExt, TryStreamExt};
    use kube::api::{Api, ListParams, WatchEvent, WatchParams};
    use kube_proxy_rs::k8s::WATCH_LABEL_SELECTOR;

    bounded(async {
        let server = ApiServer::start().await;
        populate(&server);
        let mut other = db();
        other.metadata.labels =
            Some([("service.kubernetes.io/service-proxy-name".to_string(), "other".to_string())].into());
        server.create(&other);
        let client = server.client();

        let services: Api<Service> = Api::all(client.clone());
        let list = services.list(&ListParams::default().labels(WATCH_LABEL_SELECTOR)).await.expect("list");
        let names: Vec<_> = list.items.iter().filter_map(|s| s.metadata.name.clone()).collect();
        assert_eq!(names, ["api", "web"], "labelled service excluded");
        let rv = list.metadata.resource_version.expect("list version");
        assert_eq!(rv, server.resource_version().to_string());
        let nodes: Api<Node> = Api::all(client.clone());
        let listed = nodes.list(&ListParams::default().fields("metadata.name=test-node")).await.expect("nodes");
        assert_eq!(listed.items.len(), 1);

        // Changes after the listed version arrive in order, with their versions.
        let wp = WatchParams::default().labels(WATCH_LABEL_SELECTOR);
        let mut stream = services.watch(&wp, &rv).await.expect("watch").boxed();
        server.update(&web("172.30.0.9"));
        let deleted_at = server.delete(&api());
        server.update(&other); // Not selected: not sent.
        server.create(&db_slice()); // Another kind: not sent.
        let mut seen = Vec::new();
        while seen.len() < 2 {
            match stream.try_next().await.expect("event").expect("open stream") {
                WatchEvent::Modified(s) => seen.push(("MODIFIED", s.metadata.name, s.metadata.resource_version)),
                WatchEvent::Deleted(s) => seen.push(("DELETED", s.metadata.name, s.metadata.resource_version)),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(seen[0].0, "MODIFIED");
        assert_eq!(seen[1], ("DELETED", Some("api".to_string()), Some(deleted_at.to_string())));

        // A compacted version: one ERROR event with a 410 Expired Status.
        server.compact();
        let mut stream = services.watch(&wp, &rv).await.expect("watch").boxed();
        match stream.try_next().await.expect("event") {
            Some(WatchEvent::Error(status)) => {
                assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
            }
            other => panic!("expected 410 Gone, got {other:?}"),
        }
        assert!(stream.next().await.is_none(), "the stream ends after the error");

        // Injected failures answer an error Status.
        server.fail_next(1, 500);
        match services.list(&ListParams::default()).await {
            Err(kube::Error::Api(status)) => assert_eq!(status.code, 500),
            other => panic!("expected a 500, got {other:?}"),
        }
        services.list(&ListParams::default()).await.expect("the next request works");
    })
    .await;
}
