use std::collections::HashMap;

/// The port a configuration names, or 8080 when it names none or an invalid one.
pub fn port(config: &HashMap<String, String>) -> u16 {
// @middle
    config.get("port").and_then(|p| p.parse().ok()).unwrap_or(8080)
// @end
}
// @tests
#[test]
fn ports() {
    let mut c = HashMap::new();
    assert_eq!(port(&c), 8080);
    c.insert("port".to_string(), "3000".to_string());
    assert_eq!(port(&c), 3000);
    c.insert("port".to_string(), "http".to_string());
    assert_eq!(port(&c), 8080);
}
