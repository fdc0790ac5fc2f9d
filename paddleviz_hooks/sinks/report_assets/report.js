(function(){
"use strict";
var DATA = JSON.parse(document.getElementById("pvh-data").textContent);
var slider = document.getElementById("step-slider");
var label = document.getElementById("step-label");
var strip = document.getElementById("strip");
var stage = document.getElementById("stage");
var vp = document.getElementById("viewport");
var note = document.getElementById("viewer-note");
var mode = document.getElementById("mode");
var hl = document.getElementById("highlight");
var norms = document.getElementById("norms");
var runSel = document.getElementById("run-select");
var side = document.getElementById("side");
var sideLabel = document.getElementById("side-label");
var run = 0, idx = -1, scale = 1, tx = 0, ty = 0, userView = false;

function apply(){ stage.style.transform = "translate(" + tx + "px," + ty + "px) scale(" + scale + ")"; }
function svgSize(){
  var row = stage.querySelector(".side-by-side");  // several drawings: their row's size
  if (row) { var b = row.getBoundingClientRect(); return [b.width / scale, b.height / scale]; }
  var s = stage.querySelector("svg");
  if (!s) return null;
  var vb = s.viewBox && s.viewBox.baseVal;
  var w = vb && vb.width ? vb.width : s.getBoundingClientRect().width / scale;
  var h = vb && vb.height ? vb.height : s.getBoundingClientRect().height / scale;
  return [w * 96 / 72, h * 96 / 72];
}
function place(s){
  var sz = svgSize(); if (!sz) return;
  var W = vp.clientWidth, H = vp.clientHeight;
  scale = s;
  tx = Math.max(4, (W - sz[0] * scale) / 2); ty = Math.max(4, (H - sz[1] * scale) / 2);
  apply();
}
function fit(){  // the whole drawing
  var sz = svgSize(); if (!sz) return;
  place(Math.min(vp.clientWidth / sz[0], vp.clientHeight / sz[1], 1.5) * 0.96);
}
function autoView(){  // readable: fit, but no smaller than 100% while the width allows
  var sz = svgSize(); if (!sz) return;
  var all = Math.min(vp.clientWidth / sz[0], vp.clientHeight / sz[1]);
  place(Math.min(1.5, Math.max(all, Math.min(1, vp.clientWidth / sz[0]))) * 0.96);
  var mark = stage.querySelector(norms.checked ? ".pvh-added, .pvh-removed, .pvh-ratio-up, .pvh-ratio-down, .pvh-rank-only"
                                               : ".pvh-added, .pvh-removed, .pvh-rank-only");
  if (!mark) return;
  var v = vp.getBoundingClientRect(), m = mark.getBoundingClientRect();
  if (m.top >= v.top && m.bottom <= v.bottom) return;
  ty += (v.top + v.height / 2) - (m.top + m.height / 2);  // bring the first change into view
  apply();
}
function show(r, i){
  var steps = DATA.runs[r].steps;
  i = Math.max(0, Math.min(steps.length - 1, i));
  if (r !== run) { userView = false; }
  document.getElementById("panel-" + run + "-" + Math.max(idx, 0)).hidden = true;
  document.getElementById("overview-" + run).hidden = true;
  document.getElementById("chart-" + run).hidden = true;
  run = r; idx = i;
  var st = steps[i];
  slider.max = String(steps.length - 1);
  slider.value = String(i);
  var name = "step " + st.step + (st.role ? " - " + st.role : "");  // "step 3 - micro-batch 2 of 2"
  label.textContent = name + "  (" + (i + 1) + " of " + steps.length + ")";
  // structure changes by default; gradient-norm colouring only when asked for
  var useDiff = st.diff !== null && ((hl.checked && st.changed) || norms.checked);
  var svg = useDiff ? DATA.svgs[st.diff] : (st.svg !== null ? DATA.svgs[st.svg] : null);
  var merged = !!DATA.runs[r].merged;  // one step of several ranks in one drawing
  sideLabel.hidden = !merged;
  var sideBySide = merged && side.checked && st.ranks;
  if (sideBySide) {  // each rank's own drawing, captioned with its rank
    stage.innerHTML = "";
    var row = document.createElement("div");
    row.className = "side-by-side";
    st.ranks.forEach(function(rk){
      var fig = document.createElement("figure");
      var cap = document.createElement("figcaption");
      cap.textContent = "rank " + rk[0];
      fig.appendChild(cap);
      var holder = document.createElement("div");
      holder.innerHTML = rk[1] === null ? "no drawing" : DATA.svgs[rk[1]];
      fig.appendChild(holder);
      row.appendChild(fig);
    });
    stage.appendChild(row);
    svg = "";
  } else {
    stage.innerHTML = svg === null ? "" : svg;
  }
  stage.classList.toggle("no-norms", !norms.checked);
  if (sideBySide) {
    stage.querySelectorAll("svg").forEach(function(s){  // each at its natural size (points -> px)
      var vb = s.viewBox && s.viewBox.baseVal;
      if (vb && vb.width) { s.style.width = (vb.width * 96 / 72) + "px"; s.style.height = (vb.height * 96 / 72) + "px"; }
    });
  } else {
    var s = stage.querySelector("svg");
    if (s) { var sz = svgSize(); s.style.width = sz[0] + "px"; s.style.height = sz[1] + "px"; }
  }
  mode.textContent = !useDiff ? (sideBySide ? "each rank's own drawing" : st.svg === null ? "no drawing"
                                 : merged ? "ranks merged" : "graph")
    : (norms.checked ? "changes since " : "structure changed since ") + st.since;
  mode.className = useDiff ? "diff" : (merged && st.changed ? "ranks-differ" : "");
  note.textContent = svg === null ? "No drawing for this step (see the panel)." : "wheel: zoom, drag: pan, F: fit all, 1: 100%, A: automatic view";
  document.getElementById("panel-" + r + "-" + i).hidden = false;
  document.getElementById("overview-" + r).hidden = false;
  document.getElementById("chart-" + r).hidden = false;
  var m = document.getElementById("marker-" + r);
  if (m && st.x !== undefined) { m.setAttribute("x1", st.x); m.setAttribute("x2", st.x); }
  buildStrip();
  if (!userView) { autoView(); }  // follow each step until the user zooms or pans
}
function buildStrip(){
  var steps = DATA.runs[run].steps;
  if (strip.dataset.run !== String(run)) {
    strip.innerHTML = "";
    steps.forEach(function(st, i){
      var c = document.createElement("span");
      var merged = !!DATA.runs[run].merged;
      c.className = (st.changed ? (merged ? "ranks-differ " : "changed ") : "") + (st.nonfinite ? "nonfinite" : "");
      c.title = "step " + st.step + (st.role ? " - " + st.role : "") +
        (st.changed ? (merged ? ", ranks differ in structure" : ", structure changed") : "") +
        (st.nonfinite ? ", NaN/Inf" : "");
      c.addEventListener("click", function(){ show(run, i); });
      strip.appendChild(c);
    });
    strip.dataset.run = String(run);
  }
  Array.prototype.forEach.call(strip.children, function(c, i){ c.classList.toggle("current", i === idx); });
}
slider.addEventListener("input", function(){ show(run, parseInt(slider.value, 10)); });
hl.addEventListener("change", function(){ show(run, idx); });
norms.addEventListener("change", function(){ show(run, idx); });
side.addEventListener("change", function(){ userView = false; show(run, idx); });
// a used control gives the keyboard back to the viewer (arrows step, F/1/A zoom)
document.querySelectorAll("header button, header input[type=checkbox], header select").forEach(function(c){
  c.addEventListener(c.tagName === "SELECT" ? "change" : "click", function(){ c.blur(); });
});
document.getElementById("fit").addEventListener("click", function(){ userView = true; fit(); });
document.getElementById("prev").addEventListener("click", function(){ show(run, idx - 1); });
document.getElementById("next").addEventListener("click", function(){ show(run, idx + 1); });
if (runSel) runSel.addEventListener("change", function(){ show(parseInt(runSel.value, 10), 0); });
document.querySelectorAll("button.jump").forEach(function(b){
  b.addEventListener("click", function(){
    var r = parseInt(b.dataset.run, 10);
    if (runSel) runSel.value = String(r);
    show(r, parseInt(b.dataset.step, 10));
  });
});
document.addEventListener("keydown", function(e){
  var t = e.target;
  if (t && (t.tagName === "TEXTAREA" || t.tagName === "SELECT" ||
            (t.tagName === "INPUT" && !/^(range|checkbox|radio|button)$/.test(t.type)))) return;
  if (t === slider && (e.key === "ArrowRight" || e.key === "ArrowLeft")) return;  // the slider steps itself
  if (e.key === "ArrowRight") { show(run, idx + 1); e.preventDefault(); }
  else if (e.key === "ArrowLeft") { show(run, idx - 1); e.preventDefault(); }
  else if (e.key === "f" || e.key === "F" || e.key === "0") { userView = true; fit(); }
  else if (e.key === "1") { userView = true; place(1); }
  else if (e.key === "a" || e.key === "A") { userView = false; autoView(); }
});
vp.addEventListener("wheel", function(e){
  e.preventDefault();
  var r = vp.getBoundingClientRect(), mx = e.clientX - r.left, my = e.clientY - r.top;
  var ns = Math.min(40, Math.max(0.02, scale * Math.exp(-e.deltaY * 0.0015)));
  tx = mx - (mx - tx) * ns / scale; ty = my - (my - ty) * ns / scale; scale = ns; userView = true; apply();
}, {passive: false});
var drag = null, pressed = null;
vp.addEventListener("pointerdown", function(e){
  if (e.button !== 0) return;
  pressed = e.target && e.target.closest ? e.target.closest("g.node, g.edge") : null;
  drag = [e.clientX, e.clientY, tx, ty]; vp.setPointerCapture(e.pointerId); vp.classList.add("dragging");
});
// a click (no drag) on a node or an edge lists what its tooltip says, one fact a line: a node's
// layer, the gradient it received (shape, dtype, norm, min, max, NaN, Inf, or why not observed),
// the line of code that made it; an edge's ends and the gradient on it
var nodeInfo = document.getElementById("node-info"), nodeLines = document.getElementById("node-info-lines");
var nodeHead = document.getElementById("node-info-head");
function showNode(g){
  var a = g.querySelector("a");
  var t = a ? (a.getAttributeNS("http://www.w3.org/1999/xlink", "title") || a.getAttribute("title")) : null;
  if (!t) return;
  nodeHead.textContent = g.classList.contains("edge") ? "Clicked edge" : "Clicked node";
  nodeLines.innerHTML = "";
  t.split(" | ").forEach(function(line){
    var li = document.createElement("li");
    li.textContent = line;
    nodeLines.appendChild(li);
  });
  nodeInfo.hidden = false;
}
vp.addEventListener("pointerup", function(e){
  if (drag && pressed && Math.abs(e.clientX - drag[0]) + Math.abs(e.clientY - drag[1]) < 5) showNode(pressed);
  pressed = null;
});
vp.addEventListener("pointermove", function(e){
  if (!drag) return;
  tx = drag[2] + e.clientX - drag[0]; ty = drag[3] + e.clientY - drag[1]; userView = true; apply();
});
function endDrag(){ drag = null; vp.classList.remove("dragging"); }
vp.addEventListener("pointerup", endDrag);
vp.addEventListener("pointercancel", endDrag);
window.addEventListener("resize", function(){ if (!userView) autoView(); });
// memory tables: a click on a column header sorts the rows (bytes: most first; names: A to Z)
document.querySelectorAll("table.saved").forEach(function(t){
  var shown = parseInt(t.dataset.shown, 10) || Infinity;
  t.querySelectorAll("button.sort").forEach(function(b){
    b.addEventListener("click", function(){
      var col = parseInt(b.dataset.col, 10), num = b.dataset.kind === "num";
      var body = t.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      function key(r){ var c = r.cells[col]; return num ? parseFloat(c.dataset.v) : c.textContent; }
      rows.sort(function(a, z){ return num ? key(z) - key(a) : key(a).localeCompare(key(z)); });
      rows.forEach(function(r, i){ r.hidden = i >= shown; body.appendChild(r); });
      t.querySelectorAll("th").forEach(function(th){ th.removeAttribute("aria-sort"); });
      b.parentNode.setAttribute("aria-sort", num ? "descending" : "ascending");
    });
  });
});
show(0, 0);
})();
