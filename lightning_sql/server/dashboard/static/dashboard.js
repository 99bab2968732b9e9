// lightning_sql dashboard: live refresh by short polling.  A page that shows something still moving
// (data-live-interval on <body>) fetches itself again and swaps its [data-live] regions in place;
// open <details> stay open.  The fetched HTML is parsed inertly (DOMParser), never evaluated.
(function () {
  "use strict";
  var body = document.body;
  var interval = parseInt(body.getAttribute("data-live-interval") || "0", 10);
  if (!interval) return;
  var paused = false;
  var toggle = document.getElementById("live-toggle");
  if (toggle) {
    toggle.addEventListener("click", function () {
      paused = !paused;
      toggle.classList.toggle("on", !paused);
      toggle.setAttribute("aria-pressed", String(!paused));
      toggle.textContent = paused ? "paused" : "live";
    });
  }
  function openDetails(root) {
    var open = [];
    root.querySelectorAll("details[open][data-span-pk]").forEach(function (d) { open.push(d.getAttribute("data-span-pk")); });
    return open;
  }
  async function refresh() {
    if (paused || document.hidden) return;
    try {
      var response = await fetch(window.location.href, { credentials: "same-origin", headers: { "X-Dashboard-Poll": "1" } });
      if (!response.ok) return;
      var doc = new DOMParser().parseFromString(await response.text(), "text/html");
      document.querySelectorAll("[data-live]").forEach(function (region) {
        var fresh = doc.getElementById(region.id);
        if (!fresh) return;
        var keep = openDetails(region);
        keep.forEach(function (pk) {
          var d = fresh.querySelector('details[data-span-pk="' + CSS.escape(pk) + '"]');
          if (d) d.setAttribute("open", "");
        });
        region.replaceWith(document.importNode(fresh, true));
      });
      body.setAttribute("data-refreshed", String(Date.now()));
      if (!doc.body.hasAttribute("data-live-interval")) {
        paused = true;
        if (toggle) { toggle.textContent = "done"; toggle.classList.remove("on"); }
      }
    } catch (err) {
      // The server restarted or the network dropped: try again at the next tick.
    }
  }
  window.setInterval(refresh, interval);
})();
