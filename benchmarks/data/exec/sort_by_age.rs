#[derive(Debug, Clone, PartialEq)]
pub struct Person {
    pub name: String,
    pub age: u32,
}

/// Sorts people by age, youngest first; people of the same age keep their order.
pub fn sort_by_age(people: &mut Vec<Person>) {
// @middle
    people.sort_by_key(|p| p.age);
// @end
}
// @tests
#[test]
fn sorts() {
    let p = |name: &str, age| Person { name: name.to_string(), age };
    let mut v = vec![p("ann", 40), p("bob", 25), p("cy", 40), p("di", 31)];
    sort_by_age(&mut v);
    let names: Vec<&str> = v.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(names, ["bob", "di", "ann", "cy"]);
}
